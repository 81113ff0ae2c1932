# from the repository root (the JSON was then moved to ../serve_cpu_overload.json)
python -m launcher.cli bench serve --launch disaggregated --api completions \
  --num-requests 512 --max-concurrency 128 --input-len 32:128 --output-len 16 --burst 512 \
  --verify-greedy --request-timeout-s 1200 --ready-timeout-s 300 --seed 24 \
  --out benchmarks/results/2026-12-02/cpu-overload-1/serve.json
