# Sourced by scripts/setup_env.sh and scripts/check_dists.sh: which torch a set-up installs.
# torch is 2.13.0. With CUDA (nvidia-smi on PATH; SPEC_TORCH=cuda or cpu overrides the guess) it is the
# index's default wheel, which brings its own triton. Without CUDA it is a CPU wheel: the configured
# index's when it offers one (a dry run of torch alone pulls no nvidia-*/cuda-* package), else the one on
# PyTorch's CPU index ($TORCH_CPU_INDEX). Callers set `pip` (an array: the pip command), `py` (a
# Python for scripts/install_report.py) and `tmp` (a scratch directory) before calling.
TORCH="torch==2.13.0"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

# Prints cpu or cuda; exits 2 with a one-line error on another SPEC_TORCH.
torch_device() {
  local device="${SPEC_TORCH:-}"
  if [ -z "$device" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then device=cuda; else device=cpu; fi
  fi
  if [ "$device" != cpu ] && [ "$device" != cuda ]; then
    echo "$(basename "$0"): SPEC_TORCH=$device: expected cpu or cuda" >&2
    exit 2
  fi
  echo "$device"
}

# Resolves torch alone (installs nothing) with the index flags given; prints the CUDA packages it pulls.
torch_cuda_packages() {
  if ! "${pip[@]}" install -q --dry-run --ignore-installed --report "$tmp/torch.json" "$@" \
      -c constraints-cpu.txt "$TORCH" 2>"$tmp/pip.log"; then
    cat "$tmp/pip.log" >&2
    echo "$(basename "$0"): $TORCH does not resolve ($*)" >&2
    exit 1
  fi
  "$py" scripts/install_report.py cuda "$tmp/torch.json" || true
}

# Sets the array `index` to the index flags under which $TORCH is a CPU wheel (none, or PyTorch's CPU
# index); exits 1 with the CUDA packages named when neither offers one. $tmp/torch.json is then the
# report of that torch (did it bring triton?).
cpu_torch_index() {
  index=()
  local cuda
  cuda="$(torch_cuda_packages)"
  if [ -n "$cuda" ]; then
    index=(--extra-index-url "$TORCH_CPU_INDEX")
    cuda="$(torch_cuda_packages "${index[@]}")"
    if [ -n "$cuda" ]; then
      echo "$(basename "$0"): no CPU wheel of $TORCH on the configured index nor on $TORCH_CPU_INDEX" \
        "(it would pull: $(echo "$cuda" | tr '\n' ' ')); set TORCH_CPU_INDEX" >&2
      exit 1
    fi
  fi
}
