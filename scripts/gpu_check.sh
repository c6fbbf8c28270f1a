#!/usr/bin/env bash
# GPU checks for a machine lent for a few minutes (H100/H200 class): one pass, every section
# time-boxed, each check printed as PASS / FAIL / SKIP with its time, a summary at the end.
#
#   scripts/gpu_check.sh            run everything (total budget GPU_CHECK_BUDGET_S, default 420 s)
#   scripts/gpu_check.sh --dry-run  list the sections, their time limits and what gates them
#   scripts/gpu_check.sh --cpu      run the same snippets on the CPU with small shapes (checks
#                                   the script itself; CUDA-only checks print SKIP)
#
# Sections: a) environment  b) CUDA semantics of model pieces (bf16 forward/backward vs CPU fp32,
# KDA chunk on CUDA vs the CPU recurrence, MoE without host syncs and under CUDA-graph capture)
# c) fla's chunk_kda vs the torch chunk form  d) Transformer Engine tests, a few mxfp4_qat
# training steps through the CLI and an export of that run  e) forward+backward throughput
# f) the MoonEP symm_mem transport (NVSHMEM all_to_all_vdev) against the collective one.
# Nothing is installed; a section whose package is missing prints SKIP. Output is also written to
# $OUT/gpu_check.log when OUT is set (else a temporary directory).
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-420}"
MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --cpu) MODE=cpu ;;
  "") ;;
  *) echo "usage: $0 [--dry-run|--cpu]" >&2; exit 2 ;;
esac
export GC_DEVICE=cuda
[ "$MODE" = cpu ] && export GC_DEVICE=cpu
LOG_DIR="${OUT:-$(mktemp -d)}"
mkdir -p "$LOG_DIR"
WORK="$(mktemp -d)"
export PY WORK
LOG="$LOG_DIR/gpu_check.log"
START=$(date +%s)
SUMMARY=()
FAILED=0

say() { echo "$*" | tee -a "$LOG"; }

# run_section ID TITLE LIMIT_S GATE_CMD FUNCTION: skips when GATE_CMD fails (its output is the
# reason); runs FUNCTION in a child bash that is stopped at LIMIT_S or at the end of the overall
# budget, whichever comes first.
run_section() {
  local id="$1" title="$2" limit="$3" gate="$4" fn="$5"
  if [ "$MODE" = dry ]; then
    printf '  %s) %-52s limit %4ss  gate: %s\n' "$id" "$title" "$limit" "$gate"
    return
  fi
  say ""
  say "=== $id) $title"
  local reason
  if ! reason=$(eval "$gate" 2>&1); then
    say "SKIP $id) $title: ${reason:-gate failed} (gate: $gate)"
    SUMMARY+=("SKIP  $id) $title")
    return
  fi
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt 15 ]; then
    say "SKIP $id) $title: overall budget of ${BUDGET_S}s used up"
    SUMMARY+=("SKIP  $id) $title (no time left)")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 rc dt
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$fn" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  dt=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    say "PASS $id) $title (${dt}s)"
    SUMMARY+=("PASS  $id) $title (${dt}s)")
  else
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && say "     timed out after ${limit}s"
    say "FAIL $id) $title (${dt}s, exit $rc)"
    SUMMARY+=("FAIL  $id) $title (${dt}s, exit $rc)")
    FAILED=1
  fi
}

have_cuda() {
  [ "$GC_DEVICE" = cpu ] && return 0
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || { echo "torch.cuda.is_available() is False"; return 1; }
}
have_module() {  # have_module MODULE: importable (on the GPU path also needs CUDA)
  [ "$GC_DEVICE" = cpu ] && { echo "--cpu mode"; return 1; }
  have_cuda || return 1
  "$PY" -c "import $1" >/dev/null 2>&1 || { echo "$1 does not import"; return 1; }
}

section_env() {
  if [ "$GC_DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv \
      || echo "  (nvidia-smi failed)"
  fi
  "$PY" - <<'PY'
import importlib.util, platform, sys
import torch
print(f"  python {platform.python_version()} ({sys.executable})")
print(f"  torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"  device {i}: {torch.cuda.get_device_name(i)}, "
              f"capability {torch.cuda.get_device_capability(i)}")
for name in ("transformer_engine", "fla", "triton"):
    found = importlib.util.find_spec(name) is not None
    print(f"  {name}: {'installed' if found else 'not installed'}")
from train.precision.te_backend import select_recipe
if torch.cuda.is_available():
    print(f"  TE recipe for this GPU: {select_recipe(torch.cuda.get_device_capability())}")
PY
}

# Shared helpers for the Python snippets: check() prints one PASS/FAIL/SKIP line per check and
# finish() exits 1 when any failed.
read -r -d '' PY_HELPERS <<'PY'
import os, sys, time, traceback
import torch
DEVICE = torch.device(os.environ["GC_DEVICE"])
ON_CUDA = DEVICE.type == "cuda"
_failed = []

def check(name, fn, cuda_only=False):
    if cuda_only and not ON_CUDA:
        print(f"  SKIP {name}: needs CUDA", flush=True)
        return
    t0 = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
        traceback.print_exc(limit=3)
    print(f"  {'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - t0:.1f}s) {detail}",
          flush=True)
    if not ok:
        _failed.append(name)

def finish():
    sys.exit(1 if _failed else 0)
PY
export PY_HELPERS

section_semantics() {
  "$PY" - <<'PY'
exec(__import__("os").environ["PY_HELPERS"])
from model.batch import K3Batch
from model.config import k3_tiny
from model.k3 import K3Model
from model.moe import LatentMoE
from model.ops.kda import kda_chunk, kda_recurrent
from tests.tolerances import rel_rms

torch.manual_seed(0)
cfg = k3_tiny()

def text_batch(t):
    """Two rows of t tokens, two documents per row."""
    tokens = torch.randint(1, cfg.vocab_size, (2, t))
    cu = torch.tensor([0, t // 3, t, t + t // 2, 2 * t])
    return K3Batch(tokens, tokens.roll(-1, 1), cu)

def tiny_fp32_matches_cpu():
    # The device's kernels (fla KDA when installed, sdpa, the expert loop) in fp32 against the
    # CPU's: DESIGN 5's 5e-3 for fp32 paths. TF32 off, or cuDNN's conv would round to 10 bits.
    torch.backends.cudnn.allow_tf32 = False
    model = K3Model(cfg).eval()
    batch = text_batch(128)
    with torch.no_grad():
        ref = model(batch, return_logits=True).logits
        got = model.to(DEVICE)(batch.to(DEVICE), return_logits=True).logits.cpu()
    err = rel_rms(ref, got)
    return err <= 5e-3, f"fp32 logits rel RMS vs CPU {err:.2e}"

def tiny_bf16_forward_backward():
    # bf16 autocast moves the logits by a few percent on this random model, mostly through
    # routing flips (a rounded score changes a token's top-k experts): CPU bf16 autocast
    # measured 2.6e-2 on this batch. 5e-2 catches a broken path, not bf16 noise.
    model = K3Model(cfg)
    batch = text_batch(128)
    ref = model(batch, return_logits=True)
    model.to(DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = model(batch.to(DEVICE), return_logits=True)
    (out.loss_sum / out.num_tokens).backward()
    err = rel_rms(ref.logits, out.logits.float().cpu())
    missing = [n for n, p in model.named_parameters()
               if (p.grad is None or not torch.isfinite(p.grad).all())
               and not n.startswith("vision")]
    return err <= 5e-2 and not missing, f"logits rel RMS vs CPU fp32 {err:.2e}, " \
        f"params without a finite grad: {missing[:3]}"

def kda_device_vs_cpu_recurrence():
    B, T, H, K = 1, 256, 2, 64
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v, g = torch.randn(B, T, H, K), -5 * torch.sigmoid(torch.randn(B, T, H, K))
    beta = torch.sigmoid(torch.randn(B, T, H))
    cu = torch.tensor([0, 100, 256])
    ref_o, ref_s = kda_recurrent(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    args = [x.to(DEVICE) for x in (q, k, v, g, beta)]
    o, s = kda_chunk(*args, output_final_state=True, cu_seqlens=cu.to(DEVICE), backend="torch")
    eo, es = rel_rms(ref_o, o.cpu()), rel_rms(ref_s, s.cpu())
    return max(eo, es) <= 5e-3, f"torch chunk on {DEVICE.type} vs CPU recurrence: " \
        f"o {eo:.2e}, state {es:.2e} (SPEC 2: 5e-3)"

def moe_layer():
    moe = LatentMoE(cfg).to(DEVICE)
    x = torch.randn(256, cfg.hidden_size, device=DEVICE, requires_grad=True)
    return moe, x

def run_moe(moe, x):
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = moe(x)
    y.float().square().mean().backward()
    return y

def moe_without_host_sync():
    moe, x = moe_layer()
    run_moe(moe, x)  # warm-up: lazy CUDA/cuBLAS initialisation may sync once
    # Skewed routing: the first top_k router rows point along one direction that every token
    # of `skewed` shares, so all tokens pick the same experts.
    direction = torch.nn.functional.normalize(torch.randn(cfg.hidden_size, device=DEVICE), dim=0)
    skewed = (0.1 * x.detach() + 3 * direction).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_moe(moe, x)
        with torch.no_grad():
            moe.router.weight[: cfg.moe.top_k] = direction
        run_moe(moe, skewed)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return True, "forward+backward, balanced and skewed routing, sync debug mode 'error'"

def moe_cuda_graph():
    moe, x = moe_layer()
    moe.eval()
    static_x = x.detach().clone()

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            return moe(static_x)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = forward()
    new_x = torch.randn_like(static_x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager = forward()
    err = rel_rms(eager.float(), static_y.float())
    return err <= 1e-4, f"captured forward replayed on new input vs eager: rel RMS {err:.2e}"

check("b1 k3_tiny fp32 forward on device vs CPU", tiny_fp32_matches_cpu)
check("b1 k3_tiny bf16 autocast forward+backward vs CPU fp32", tiny_bf16_forward_backward)
check("b2 kda_chunk on device vs kda_recurrent on CPU", kda_device_vs_cpu_recurrence)
check("b3 MoE layer with no host sync", moe_without_host_sync, cuda_only=True)
check("b4 MoE layer forward under CUDA-graph capture", moe_cuda_graph, cuda_only=True)
finish()
PY
}

section_fla() {
  "$PY" - <<'PY'
exec(__import__("os").environ["PY_HELPERS"])
from model.ops.kda import kda_chunk
from tests.tolerances import rel_rms

torch.manual_seed(0)
B, T, H, K = 1, 1024, 4, 128

def inputs():
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=DEVICE), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=DEVICE), dim=-1)
    v = torch.randn(B, T, H, K, device=DEVICE)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, device=DEVICE))
    beta = torch.sigmoid(torch.randn(B, T, H, device=DEVICE))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]

def compare(lower_bound, packed):
    cu = torch.tensor([0, 300, 700, T], device=DEVICE) if packed else None
    xs = inputs()
    results = {}
    for backend in ("torch", "fla"):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, s = kda_chunk(*leaves, output_final_state=True, cu_seqlens=cu, backend=backend,
                         lower_bound=lower_bound)
        (o.float().square().sum() + s.float().square().sum()).backward()
        results[backend] = [o, s] + [x.grad for x in leaves]
    names = ("o", "state", "dq", "dk", "dv", "dg", "dbeta")
    tols = (5e-3, 5e-3, 8e-3, 8e-3, 8e-3, 2e-2, 2e-2)  # SPEC 2 (fla's own test tolerances)
    errs = [rel_rms(a.float(), b.float()) for a, b in zip(results["torch"], results["fla"])]
    detail = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs))
    return all(e <= t for e, t in zip(errs, tols)), detail

for lb in (None, -5.0):
    for packed in (False, True):
        check(f"c fla vs torch chunk_kda fp32 (lower_bound={lb}, packed={packed})",
              lambda lb=lb, packed=packed: compare(lb, packed))
finish()
PY
}

section_moonep_symm_mem() {
  # One NCCL rank per GPU (up to 4); the test skips itself without NVSHMEM (its reason is printed).
  "$PY" -m pytest -q -p no:cacheprovider tests/distributed/test_moonep_symm_mem.py -rs
}

section_te_tests() {
  "$PY" -m pytest -q -p no:cacheprovider tests/unit/train/test_te_backend.py -rs
}

section_train_and_export() {
  local run="$WORK/qat_run" dev="$GC_DEVICE"
  "$PY" -m train.cli device="$dev" precision=mxfp4_qat steps=5 run_dir="$run" \
    model.moe.expert_intermediate=64 logging.wandb=false logging.plot=false \
    checkpoint.every=0 checkpoint.save_at_end=true || return 1
  grep -h "Transformer Engine\|training k3_tiny" "$run"/*.log 2>/dev/null | sed 's/^/  log: /'
  "$PY" -m train.export --run-dir "$run" --dtype fp32 --out "$WORK/qat_export" || return 1
  "$PY" - "$WORK/qat_export" <<'PY'
exec(__import__("os").environ["PY_HELPERS"])
from model.batch import K3Batch
from train.export import load_exported

def reload():
    model = load_exported(sys.argv[1], DEVICE)
    tokens = torch.randint(1, model.cfg.vocab_size, (1, 64), device=DEVICE)
    with torch.no_grad():
        out = model(K3Batch(tokens, tokens, torch.tensor([0, 64], device=DEVICE)))
    loss = float(out.loss_sum / out.num_tokens)
    return torch.isfinite(out.loss_sum).item(), f"reloaded export, loss {loss:.3f}"

check("d3 load_exported + forward", reload)
finish()
PY
}

section_throughput() {
  "$PY" - <<'PY'
exec(__import__("os").environ["PY_HELPERS"])
import dataclasses
from model.batch import K3Batch
from model.config import k3_small, k3_tiny
from model.k3 import K3Model
from model.ops.kda import _fla_chunk_kda
from train.config import PrecisionConfig
from train.precision.recipe import PrecisionRecipe

small = dataclasses.replace(k3_small(), num_layers=4, vision=None).validate()
cases = [("k3_tiny", k3_tiny(), 8, 512), ("k3_small, 4 layers", small, 4, 2048)]
if not ON_CUDA:
    cases = [("k3_tiny", k3_tiny(), 1, 128)]
print(f"  KDA kernel: {'fla' if ON_CUDA and _fla_chunk_kda() else 'torch chunk'}", flush=True)

def measure(cfg, batch, seq, use_te):
    model = K3Model(cfg).to(DEVICE)
    if use_te:
        plan = PrecisionRecipe.build(PrecisionConfig("bf16"), DEVICE, model)
        if plan.te is None:
            return True, "TE plan not available on this GPU (see log)"
    else:
        plan = PrecisionRecipe(torch.bfloat16 if ON_CUDA else None, DEVICE.type, False)
    tokens = torch.randint(1, cfg.vocab_size, (batch, seq), device=DEVICE)
    cu = torch.arange(0, batch * seq + 1, seq, device=DEVICE)
    data = K3Batch(tokens, tokens.roll(-1, 1), cu)

    def step():
        with plan.autocast():
            out = model(data)
        out.loss_sum.backward()

    for _ in range(2):
        step()
    if ON_CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    iters = 5 if ON_CUDA else 1
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if ON_CUDA:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    mem = torch.cuda.max_memory_allocated() / 2**30 if ON_CUDA else 0.0
    return True, (f"{batch * seq / dt:,.0f} tokens/s forward+backward ({dt * 1e3:.0f} ms/step, "
                  f"{batch}x{seq} tokens, peak {mem:.1f} GiB, {plan.describe()})")

for name, cfg, batch, seq in cases:
    check(f"e {name} bf16", lambda c=cfg, b=batch, s=seq: measure(c, b, s, False))
    if ON_CUDA:
        check(f"e {name} bf16 + TE", lambda c=cfg, b=batch, s=seq: measure(c, b, s, True))
finish()
PY
}

export -f section_env section_semantics section_fla section_te_tests section_train_and_export \
  section_throughput section_moonep_symm_mem

[ "$MODE" = dry ] && echo "gpu_check sections (overall budget ${BUDGET_S}s):"
# The TE test file also has CPU tests, and its GPU tests skip themselves without TE.
run_section a "environment" 30 "true" section_env
run_section b "CUDA semantics: tiny model, KDA, MoE sync/graph" 100 "have_cuda" section_semantics
run_section c "fla chunk_kda vs torch chunk form" 60 "have_module fla.ops.kda" section_fla
run_section d1 "Transformer Engine backend tests" 45 "have_cuda" section_te_tests
run_section d2 "mxfp4_qat training (5 steps, CLI) + export" 110 "have_cuda" \
  section_train_and_export
# f before e: a correctness check is worth more than the throughput numbers if time runs out.
run_section f "MoonEP symm_mem transport vs collective (NCCL)" 90 "have_cuda" \
  section_moonep_symm_mem
run_section e "throughput forward+backward" 120 "have_cuda" section_throughput
[ "$MODE" = dry ] && exit 0

say ""
say "=== summary ($(($(date +%s) - START))s, device $GC_DEVICE, log $LOG)"
for line in "${SUMMARY[@]}"; do say "  $line"; done
rm -rf "$WORK"
exit "$FAILED"
