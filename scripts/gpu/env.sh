# Sourced at the start of every device-tool command: carried wheels, safe NCCL/multicast settings.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/tandem-flashinfer
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
# FlashInfer modules built on an earlier machine, carried as .cache/fi (no JIT rebuild on this one)
if [ -f .cache/fi/flashinfer-cache.tar.xz ]; then python3 - <<'PY'
import tarfile
try:
    from flashinfer.jit import env
except ImportError:
    print("FlashInfer not installed: .cache/fi not restored")
else:
    with tarfile.open(".cache/fi/flashinfer-cache.tar.xz") as t:
        so = [m for m in t.getmembers() if m.name.endswith(".so")]
        t.extractall(env.FLASHINFER_AOT_DIR, members=so, filter="data")
    print("restored", len(so), "FlashInfer modules")
PY
fi
