#!/usr/bin/env bash
# The several-GPU benchmarks of one machine, piece by piece, each under its own time limit, so a piece
# that overruns costs only its own figures. Results go to OUTDIR:
# one JSON per piece and one log of them all (suite.log); every piece prints its wall time.
#
#   bash bench/gpu_suite.sh OUTDIR matrix moe pipeline        # pieces in the order given
#   SMOKE=1 bash bench/gpu_suite.sh /tmp/s matrix moe         # the same commands on CPU (gloo, tiny shapes)
#   BUDGET=580 bash bench/gpu_suite.sh OUTDIR matrix moe      # all pieces within 580 s: each piece's limit is cut
#                                                             # to what is left, one with under 60 s left is skipped
#
# Pieces (N = every visible GPU; seconds = the limit of each):
#   matrix     bench/layouts.py --gpus N on real text (.bench_data/llama32k.bin when present)   570 s
#              (MATRIX_GPUS=2 MATRIX_ONLY=ep2,ep2-zero1: fewer GPUs, chosen layouts)
#   small      the same matrix at small shapes (what tests/gpu/test_layouts_nccl.py runs)        300 s
#   tp         bench/tensor_parallel.py at tp=N, both widths, with a profile                    300 s
#              (TP_ARGS replaces `--profile`, e.g. "--shapes llama1b_width --compile default,reduce-overhead";
#              TP_LIMIT replaces the 300 s)
#   determinism  bench/determinism.py: which kernels repeat bit for bit (one GPU)                  90 s
#   moe        bench/moe.py, ep = 1, 2 .. N                                                      240 s
#              (MOE_ARGS: more arguments, e.g. "--compile --compile-only --a2a-chunks 1 --only dense,moe_ep1,moe_ep2";
#              MOE_LIMIT replaces the 240 s: four compiled models and the compiled parity check need ~330 s)
#   pipeline   bench/pipeline.py at pp=N (PIPE_ARGS: more arguments, e.g. "--schedules 1f1b zb-h1 --profile") 240 s
#   fsdp2      bench/fsdp2_compare.py at dp=N, llama-8b blocks then llama-1b                      300 s
#              (FSDP2_ARGS: more arguments to both, e.g. "--compile --layers 16"; FSDP2_LIMIT replaces each 150 s)
#   ddp        bench/ddp_compare.py at dp=N, eager and compiled (DDP_ARGS: more arguments)       240 s
#   planner    bench/planner_validate.py --gpus N (its budget 420 s: 32 layers on an H200, the
#              relaunches included), then --check-pick                                           610 s
#   scaling    bench/multi_gpu.py --only scaling (weak scaling 1 -> N, ZeRO 1-3)                 300 s
#   reshard    bench/reshard.py (dp=N ZeRO-3 saved, dp=1 resumed)                                200 s
#   context    bench/context.py: memory, forms, speed (vs torch context_parallel + FSDP2), scaling  300 s each
#   ckpt       bench/checkpoint_async.py --phases save: Llama-3 8B under ZeRO-3 at dp=N, a synchronous
#              save, then asynchronous ones, each's blocking and write seconds (CKPT_WORK: a folder with
#              room for two checkpoints, ~200 GB; default OUTDIR/ckpt_work)                       590 s
#   ckpt_resume  the same bench's resume (dp=N, bit for bit) and reshard (dp=N/2) of its checkpoint 590 s
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: bench/gpu_suite.sh OUTDIR PIECE...}"); shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
py=${PYTHON:-python3}
if [ -n "${SMOKE:-}" ]; then n=${GPUS:-2}; smoke=--smoke; else n=${GPUS:-$($py -c 'import torch; print(torch.cuda.device_count())')}; smoke=; fi
tokens=(); [ -z "$smoke" ] && [ -f .bench_data/llama32k.bin ] && tokens=(--tokens .bench_data/llama32k.bin)
tr=("$py" -m torch.distributed.run --standalone --nproc-per-node "$n")
eps=$(seq -s, 1 "$n" | awk -F, '{s="1"; for (i = 2; i <= NF; i *= 2) s = s "," i; print s}')

budget=${BUDGET:-100000}
piece() {  # name limit command...: run one piece, its output appended to OUTDIR/suite.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS left=$((budget - SECONDS))
    if [ "$left" -lt 60 ]; then echo "== $name: skipped, ${left}s of the budget left" | tee -a "$out/suite.log"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name (limit ${limit}s): $*" | tee -a "$out/suite.log"
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$out/.piece.log" 2>&1
    local rc=$?
    cat "$out/.piece.log" >>"$out/suite.log"
    echo "== $name: status $rc after $((SECONDS - t0)) s" | tee -a "$out/suite.log"
    grep -v '^[][{} "]' "$out/.piece.log" | tail -n 20  # the end of the log, without the JSON
    rm -f "$out/.piece.log"
}

for p in "$@"; do
    case $p in
        matrix)   piece matrix 570 "$py" bench/layouts.py --gpus "${MATRIX_GPUS:-$n}" ${MATRIX_ONLY:+--only "$MATRIX_ONLY"} \
                      "${tokens[@]}" $smoke --out "$out/layouts${MATRIX_GPUS:+_$MATRIX_GPUS}.json" ;;
        small)    piece small 300 "$py" bench/layouts.py --gpus "$n" --small --fp32-steps 3 --bf16-steps 5 $smoke \
                      --out "$out/layouts_small.json" ;;
        tp)       piece tp "${TP_LIMIT:-300}" "${tr[@]}" bench/tensor_parallel.py ${TP_ARGS:---profile} $smoke --out "$out/tp.json" ;;
        determinism) piece determinism 90 "$py" bench/determinism.py $smoke --out "$out/determinism.json" ;;
        moe)      piece moe "${MOE_LIMIT:-240}" "${tr[@]}" bench/moe.py --ep "$eps" ${MOE_ARGS:-} $smoke --out "$out/moe.json" ;;
        pipeline) piece pipeline 240 "$py" bench/pipeline.py ${PIPE_ARGS:-} $smoke --out "$out/pipeline.json" ;;
        ddp)      piece ddp 240 "${tr[@]}" bench/ddp_compare.py --compile ${DDP_ARGS:-} $smoke --out "$out/ddp.json" ;;
        fsdp2)    piece fsdp2 "${FSDP2_LIMIT:-150}" "${tr[@]}" bench/fsdp2_compare.py ${FSDP2_ARGS:-} $smoke \
                      --out "$out/fsdp2_8b.json"
                  piece fsdp2_1b "${FSDP2_LIMIT:-150}" "${tr[@]}" bench/fsdp2_compare.py --model llama-1b --micro-batch 4 \
                      ${FSDP2_ARGS:-} $smoke --out "$out/fsdp2_1b.json" ;;
        planner)  pb=$((budget - SECONDS - 40)); [ "$pb" -gt 420 ] && pb=420  # inside the piece's limit
                  piece planner 460 "$py" bench/planner_validate.py --gpus "$n" --budget-s "$pb" $smoke --table \
                      --out "$out/planner.json"
                  piece pick 150 "$py" bench/planner_validate.py --gpus "$n" --check-pick --hw-file "$out/planner.json" \
                      $smoke --table --out "$out/pick.json" ;;
        scaling)  piece scaling 300 "$py" bench/multi_gpu.py --only scaling $smoke --out "$out/scaling.json" ;;
        reshard)  piece reshard 200 "$py" bench/reshard.py $smoke --out "$out/reshard.json" ;;
        context)  for part in memory forms speed scaling; do  # each part its own limit (CONTEXT_LIMIT replaces 300 s)
                      piece "context_$part" "${CONTEXT_LIMIT:-300}" "$py" bench/context.py $part --gpus "$n" \
                          $smoke --out "$out/context_$part.json"
                  done ;;
        ckpt)     piece ckpt 590 "$py" bench/checkpoint_async.py --phases save --saves 1 --work "${CKPT_WORK:-$out/ckpt_work}" \
                      $smoke --out "$out/checkpoint_async_save.json" ;;
        ckpt_resume) piece ckpt_resume 590 "$py" bench/checkpoint_async.py --phases resume,reshard \
                      --work "${CKPT_WORK:-$out/ckpt_work}" $smoke --out "$out/checkpoint_async.json" ;;
        *) echo "bench/gpu_suite.sh: unknown piece '$p' (matrix, small, tp, determinism, moe, pipeline, fsdp2, ddp, planner, scaling, reshard, context, ckpt, ckpt_resume)"; exit 2 ;;
    esac
done
