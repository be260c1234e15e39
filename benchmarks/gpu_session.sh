#!/usr/bin/env bash
# The prepared check for a session lent a GPU (docs/gpu.md): doctor, every GPU test, then the
# per-call table, in one command on the GPU machine, its outputs under $OUT.
# Here, first: ../shared/gpu/pack-onnxruntime-gpu.sh . (four parts, .p1 .. .p4). Then carry
# each part in a call of its own, copying it out of the checkout (an uncarried path is removed):
#   run(carry=[".p1"], command="mkdir -p /tmp/ort-parts && cp .p1/* /tmp/ort-parts/")  (.p2, .p3)
#   run(carry=[".p4"], command="cp .p4/* /tmp/ort-parts/ && bash benchmarks/gpu_session.sh")
# The machine's own python3 holds torch, transformers, onnx and safetensors; specrt runs from
# src. GPU_CALLS overrides gpu_calls.py's arguments (a dry run on the CPU: "--device cpu ...");
# the default fits the call's time: fp16 (the goals' precision), 10 repeats, the CPU graph
# beside the GPU graph's matmul form with and without CUDA graphs (each form is an export of
# minutes; GPU_CALLS="--precisions fp16 --attentions onnx,onnx+graphs" measures the other).
set -uo pipefail
out=${OUT:-/tmp/gpu-session}; parts=${PARTS:-/tmp/ort-parts}; ort=/tmp/ort-gpu
mkdir -p "$out"
if [ -f "$parts/part.03" ] && [ ! -d "$ort/onnxruntime" ]; then  # as shared/gpu/unpack does
  (cd "$parts" && cat part.00 part.01 part.02 part.03 > payload.tar && tar -xf payload.tar \
    && mkdir -p "$ort" && tar -xJf rest.tar.xz -C "$ort" \
    && xz -T0 -dc cuda.so.xz > "$ort/onnxruntime/capi/libonnxruntime_providers_cuda.so")
fi
export PYTHONPATH="$ort:$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
$python -m specrt.cli doctor 2>&1 | tee "$out/doctor.txt"
timeout 200 $python -m pytest -q -p no:cacheprovider tests/test_gpu_engines.py \
  tests/test_gpu_plans.py 2>&1 | tee "$out/tests.txt" | tail -25
# shellcheck disable=SC2086
defaults="--precisions fp16 --repeat 10 --attentions in_place,matmul,matmul+graphs"
timeout 360 $python benchmarks/gpu_calls.py ${GPU_CALLS:-$defaults} \
  --out "$out/gpu-calls" \
  2>"$out/gpu-calls.log" || tail -20 "$out/gpu-calls.log"
ls -la "$out"
