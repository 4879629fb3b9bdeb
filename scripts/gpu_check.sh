#!/usr/bin/env bash
# radixlm's checks on a CUDA machine that has torch, triton, transformers and pytest but no
# package index (the device machine): the kernel tests (CUDA variants included), then the kernel
# benchmarks. Logs go to $OUT (default /tmp/radixlm-gpu). Run from the repository root:
#
#     bash scripts/gpu_check.sh [tests] [bench] [spec]   # tests and bench when none is named
#
# Tests that build a tiny random-weight model copy the default model's tokenizer files; the
# weights (~540 MB) are not needed. Put tokenizer.json and tokenizer_config.json in ./_tok
# (copied from `radixlm.runtime.models.loader.resolve_model_path(None)`) to enable them.
# `spec` (speculative decoding on CUDA: the CUDA int4 linear, greedy identity on the real
# default model, then `bench_speculative.py`) needs the default model: its GGUF (~94 MiB, from
# `default_gguf_path()`) in $RADIXLM_CACHE/downloads/, converted there on first use.
set -uo pipefail
OUT=${OUT:-/tmp/radixlm-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export RADIXLM_CACHE=${RADIXLM_CACHE:-/tmp/radixlm-cache}
if [ -f _tok/tokenizer.json ]; then
    d=$RADIXLM_CACHE/models/SmolLM2-135M-Instruct
    mkdir -p "$d" && cp _tok/tokenizer.json _tok/tokenizer_config.json "$d"/ && touch "$d"/.complete
fi
stages=${*:-tests bench}
python3 -c "import torch, triton, transformers; p = torch.cuda.get_device_properties(0);
print(torch.cuda.get_device_name(0), p.multi_processor_count, 'SMs', p.total_memory >> 20, 'MiB');
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" \
    2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$OUT/env.txt" 2>&1
rc=0
if [[ " $stages " == *" tests "* ]]; then
    timeout ${TEST_TIMEOUT:-400} python3 -m pytest tests/kernels -q -rfEs --tb=short \
        -p no:cacheprovider --durations=10 --ignore tests/kernels/test_triton_engine_cuda.py \
        2>&1 | tee "$OUT/tests.txt" || rc=1
    # The engine on CUDA vs transformers; -s shows the bf16 agreement figures it prints.
    timeout ${ENGINE_TIMEOUT:-300} python3 -m pytest tests/kernels/test_triton_engine_cuda.py \
        -q -s -rfEs --tb=short -p no:cacheprovider 2>&1 | grep -v "Writing model shards" \
        | tee "$OUT/engine.txt" || rc=1
fi
if [[ " $stages " == *" bench "* ]]; then
    {
        python3 benchmarks/kernels/bench_decode_attention.py --out "$OUT/decode_64x4k.json"
        for s in auto 32 64; do
            python3 benchmarks/kernels/bench_decode_attention.py --batch 1 --context 32768 \
                --no-torch --splits $s
        done
        python3 benchmarks/kernels/bench_extend_attention.py --out "$OUT/extend.json" \
            ${EXTEND_CONFIGS:+--configs $EXTEND_CONFIGS}
        python3 benchmarks/kernels/bench_model_step.py --layers 8 --profile \
            --out "$OUT/model_step.json"
    } 2>&1 | tee "$OUT/bench.txt" || rc=1
fi
if [[ " $stages " == *" spec "* ]]; then
    timeout ${SPEC_TEST_TIMEOUT:-240} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
        tests/runtime/test_quantization.py::test_cuda_int4_linear_matches_dequantized_reference \
        "tests/e2e/test_token_exact.py::test_greedy_matches_transformers[cache-spec-ngram]" \
        "tests/e2e/test_token_exact.py::test_greedy_matches_transformers[cache-spec-draft]" \
        tests/e2e/test_constrained.py::test_speculative_decoding_under_a_schema_changes_no_token \
        2>&1 | tee "$OUT/spec_tests.txt" || rc=1
    timeout ${SPEC_BENCH_TIMEOUT:-300} python3 benchmarks/bench_speculative.py --threads 16 \
        --tokens 128 --batches ${SPEC_BATCHES:-1,8,64} --reps 2 --modes plain,ngram \
        --disable-by-batch-size 128 --workloads ${SPEC_WORKLOADS:-free,extract,edit,agent-json,quote} \
        --out "$OUT/speculative.json" 2>&1 | tee "$OUT/spec_bench.txt" || rc=1
fi
exit $rc
