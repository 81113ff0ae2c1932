# Sourced on the GPU machine after env.sh: unpacks .cache/dgcarry (scripts/pack_deepgemm_carry.sh).
if [ -f .cache/dgcarry/headers.tar.xz ]; then
  mkdir -p /tmp/dg && tar xJf .cache/dgcarry/headers.tar.xz -C /tmp/dg
  export TANDEM_DEEPGEMM_INCLUDE=/tmp/dg/deep_gemm/include
  export TANDEM_CACHE=$PWD/.cache
  tar xJf .cache/dgcarry/launchers.tar.xz -C .cache
  echo "DeepGEMM headers $(cat /tmp/dg/deep_gemm/VERSION), $(ls .cache/deepgemm | wc -l) launchers"
fi
