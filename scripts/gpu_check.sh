#!/usr/bin/env bash
# GPU tests and benchmarks in one call; everything lands under $OUT (default: ./out).
#   scripts/gpu_check.sh [kernels] [tests] [bench] [e2b] [profile] [gemv] [gemv_sweep] [flex_decode] [attention] [attention_tiles] [rollouts...] [sampling] [grpo] [trl] [zero_copy] [startup] [startup_carried] [startup_trees] [lever_bounds] [card] [fourbit] [multi_gpu] [trained] [learning...]
#   (no argument: kernels tests bench e2b profile; each phase must fit the 10-minute limit of one
#   device call, so call it with one or two phases at a time)
# kernels: which flex_attention kernel options work at head_dim 256/512 (prefill and decode)
# tests:   tests/test_gpu.py (float32 tokens = HF eager, with CUDA graphs and compiled + fused; bf16
#          eager = graph; bf16 decode logit error of the fastest mode vs HF bf16's; every Triton GEMM
#          config against fp64; 4.6 min on an H200 before the skinny race went to 64 rows, now over
#          400 s for 16 of its 22 tests: give it a device call of its own)
# bench:   the CLIs on tiny checkpoints (CUDA graphs, LoRA + drift check, 4-bit) and a dummy Qwen3-4B
# e2b:     the Gemma CLI on the E2B architecture (--load_format dummy, bf16), batch 64 and 1
# profile: per-kernel GPU time of E2B decode steps and CUDA-graph replay time, batch 1 and 64
# gemv:    few-row GEMMs on E2B's decode weight shapes, cuBLAS vs the Triton GEMV configs and
#          skinny_linear's picks, M 1/2/8/16 (not in the default phases; 24 s on an H200)
# flex_decode: the decode half of the kernel-option sweep, batch 1/8/64, partial vs full blocks (2.75 min)
# gemv_sweep: the same at 64 and 32 rows over a grid of 30 kernel configs (bench_gemv.py SWEEP_CONFIGS; under 2 min on an H200)
# attention_tiles: the Triton decode attention's tile options (positions a step, warps, stages) at 64 and 256 rows (about 1 min)
# attention: decode attention over the paged cache, the engine's op with flex's kernel and with the Triton paged
#            kernel (and that kernel at every split count), E2B's two attention kinds and Qwen3-4B's, batch 1/8/64/256
# The side-by-side benchmark (scripts/benchmarks/bench_rollouts.py, E2B batch 1/8/64, 512 new
# tokens), split so that each phase fits one 10-minute device call (times estimated from the per-system
# times measured on an H200):
# rollouts:            this engine, CUDA graphs and compiled + fused step, with kernel profiles (~6 min)
# rollouts_quick:      the compiled + fused step alone, batch 64 and 1, with kernel profiles (2 min)
# rollouts_targets:    the same at the speed issue's three batch sizes, 256, 64 and 1 (~4.5 min)
# sampling:            the token choice alone (greedy, sampling, top-k + top-p; batch 1/64/256), then the whole step:
#                      greedy, temperature-1 sampling with log-probs, and top-k 50 + top-p 0.9, batch 64 and 256
# grpo:                32 prompts of 256 tokens x n = 8, lengths 64..1024, shared vs separate prompt pages, and HF generate(do_sample)
# rollouts_rest:       its batch-8 row, batch 1 with cuBLAS for every GEMM, HF (dynamic cache, generate_batch) at 64 and 1 (5 min)
# rollouts_ablation:   this engine, eager decode and the compiled step without fused projections (~7 min)
# rollouts_qwen3:      the Qwen3-4B-shaped row, batch 64 (~4 min)
# rollouts_hf:         HF generate with the dynamic cache, and generate_batch (~5 min)
# rollouts_hf_compile: HF generate with a static cache and torch.compile (on torch 2.11 + transformers 5.17
#                      it segfaulted at batch 64 in its first generate; HF_COMPILE_MODE=default did not
#                      finish batch 64 in 220 s)
# trl:                 TRL's GRPOTrainer (LoRA, 8 prompts x 8 completions of 256 tokens, bf16), rollouts on the engine's
#                      fastest mode: TRL's sampling log-prob difference for the engine and for HF generate (tiny Gemma-4
#                      and E2B shape), then the E2B step time against TRL's own generation (~8 min)
# startup:             start-up to the 256 bucket (the fastest mode, bench_rollouts' warm-up: compile, capture, GEMM races) on
#                      empty caches, then again in a second process on the caches the first left; packs those caches and the
#                      first process's torch mega-cache into $OUT/startup_cache.tar.xz.* (15 MB parts)
# startup_carried:     on a fresh machine, with those parts carried in .whl/startup_cache: start-up on the mega-cache alone
#                      (and the race picks), then on all the carried cache folders ($STARTUP_COLD=1: first on empty caches)
# startup_trees:       the cold start-up of this tree and of each tree in $STARTUP_TREES (other commits' copies under
#                      .whl, carried), one after another on the same machine, each on empty caches of its own (~90 s a tree)
# lever_bounds:        the fastest mode's decode step at batch 1/64/256 without its PLE blocks and without the split
#                      combine: the most folding either into fewer kernels could save (bench_lever_bounds.py; ~4 min)
# card:                the largest GRPO batch (E2B, LoRA r16, micro batch 8, gradient checkpointing) that fits a smaller card
#                      ($CARD_GB, default 24; simulated with --gpu_memory_gb) with the engine in zero copy, TRL's own generation
#                      and the engine on a copy; all runs in $OUT/card_${CARD_GB}gb.json ($CARD_RUNS picks); a run that
#                      finished (or ran out of memory) in an earlier call on the same warm machine is not run again
# zero_copy:           the zero-copy GPU tests, then TRL's E2B step (8 x 8 x 256, LoRA r$LORA_R, default 16) with the engine on
#                      the trainer's own model (zero copy, compiled step + CUDA graphs, KV pool asleep between rollouts; with
#                      fused projections, and without), on a copy of its own (fused projections, merged adapter) and TRL's
#                      own generation: step time and each step's peak memory (~10 min; $ZERO_COPY_RUNS picks among
#                      zero_copy_fused zero_copy copy hf, and bench: bench_zero_copy.py's split of one rollout, zero
#                      copy fused against the copy, about 3 min; $ZERO_COPY_ARGS adds grpo_trl flags to all)
# fourbit:             the 4-bit GPU test (tiny Qwen3, Llama, Gemma-4: float32-compute NF4 + unmerged LoRA = HF + PEFT,
#                      eager and compiled under CUDA graphs), then E2B in NF4 (bf16 compute), compiled step + CUDA graphs,
#                      batch 1 and 64, without and with a rank-16 LoRA adapter, with kernel profiles; carry .whl/bnb (~7 min)
# trained:             the GPU-size trained checkpoint (scripts/train_checkpoints.py --size gpu, a scaled-down E2B, on the
#                      standard library carried in .whl/corpus/stdlib.tar.xz, else this Python's; skipped when already
#                      there), then TRL's sampling log-prob difference on it (engine, HF generate, the trainer's recompute
#                      noise) in bf16 with the engine's fastest mode, on a copy of the weights ($FIDELITY_WEIGHTS=shared: zero
#                      copy fused, the trainer's own model) (~6 min)
# learning:            GRPO on that checkpoint (the Python task): TRL with $LEARNING_RUNS (default: the engine's rollouts
#                      and TRL's own generation; engine_corrected: the engine with TRL's importance-sampling correction)
#                      for each of $LEARNING_SEEDS (default 0 1 2), $LEARNING_STEPS steps (20); a run file each in
#                      out/learning (kept while the machine is warm: a later call resumes), all of them in
#                      $OUT/learning_$LEARNING_TAG.json after each run. It trains the checkpoint first on a fresh machine.
# multi_gpu: data-parallel scaling, the e2b batch-64 graph run (64 prompts per GPU) through torchrun
#            on 1 GPU and on every GPU of the host: total tok/s on N GPUs vs 1
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT/stats"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (the engine sets these too, unless set): it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
phases=${*:-kernels tests bench e2b profile}
if ls .whl/bnb/bitsandbytes-*.whl >/dev/null 2>&1 && ! $PY -c "import bitsandbytes" 2>/dev/null; then  # carried: the image has none
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/bnb/*.whl && export PYTHONPATH=/tmp/site
fi

if ls .whl/trl/trl-*.whl >/dev/null 2>&1 && ! $PY -c "import trl" 2>/dev/null; then  # TRL and what it needs that the image lacks
  wheels=".whl/trl/*.whl"
  $PY -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 21)" 2>/dev/null || wheels="$wheels .whl/pyarrow/*.whl"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_trl $wheels && export PYTHONPATH=/tmp/site_trl${PYTHONPATH:+:$PYTHONPATH}
fi

with_caches() {  # with_caches ROOT CMD...: CMD with inductor's, Triton's and the race picks' caches under ROOT
  local root=$1; shift
  TORCHINDUCTOR_CACHE_DIR=$root/inductor TRITON_CACHE_DIR=$root/triton FLEX_INFERENCE_CACHE_DIR=$root/flex "$@"
}

train_gpu_checkpoint() {  # the GPU-size trained Gemma-4, unless this machine has it already
  [ -f checkpoints/trained_gpu/gemma4/REPORT.json ] && return
  run train_gpu $PY -m scripts.train_checkpoints --size gpu $stdlib --out checkpoints/trained_gpu
}

run() {  # run NAME CMD...: logs the command, its status and its time
  local name=$1; shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@"
  local status=$?
  echo "== $name: exit $status after $((SECONDS - start)) s"
  return $status
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  $PY scripts/make_tiny_checkpoints.py
  tiny=checkpoints/tiny
  common="--device cuda --quiet --n_rounds 2"
  fastest="--capture_cudagraph --compile_decode --fuse_projections"
  on_copy="$fastest --engine_weights copy"  # grpo_trl's fastest mode on a copy of the weights: the documented TRL runs
  stdlib=""  # the trained checkpoints' corpus: the standard library carried from the development machine, else this Python's
  if [ -f .whl/corpus/stdlib.tar.xz ]; then
    mkdir -p /tmp/stdlib && tar -xJf .whl/corpus/stdlib.tar.xz -C /tmp/stdlib && stdlib="--stdlib /tmp/stdlib"
  fi
  learn="$stdlib --device cuda --dtype bfloat16 --num_prompts 8 --num_generations 8 --max_completion_length ${LEARNING_MAX_TOKENS:-256} --learning_rate ${LEARNING_RATE:-1e-3}"
  for phase in $phases; do
    case $phase in
      kernels)
        run kernel_options $PY -m scripts.benchmarks.flex_kernel_options --out "$OUT/kernel_options.json" ;;
      tests)
        run gpu_tests $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py ;;
      bench)
        run qwen3_tiny_graph $PY qwen3_flex_inference.py --model_name $tiny/qwen3 $common --dtype float32 --capture_cudagraph \
          --n_prompts 16 --max_batch_size 8 --max_seq_length 512 --n_pages 64 --page_size 16 --max_new_tokens 64 --stats_path "$OUT/stats/qwen3_tiny_graph.json"
        run gemma4_tiny_lora_graph $PY gemma4_flex_inference.py --model_name $tiny/gemma4 $common --dtype float32 --capture_cudagraph \
          --lora_adapter $tiny/gemma4_text/lora --verify_no_drift --n_prompts 16 --max_batch_size 8 --max_seq_length 512 --n_pages 64 --page_size 16 \
          --max_new_tokens 64 --stats_path "$OUT/stats/gemma4_tiny_lora_graph.json"
        run qwen3_tiny_4bit $PY qwen3_flex_inference.py --model_name $tiny/qwen3 $common --dtype bfloat16 --load_in_4bit \
          --lora_adapter $tiny/qwen3/lora --n_prompts 8 --max_batch_size 8 --max_seq_length 512 --n_pages 64 --page_size 16 --max_new_tokens 32 \
          --stats_path "$OUT/stats/qwen3_tiny_4bit.json"
        run qwen3_4b_b64_graph $PY qwen3_flex_inference.py --model_name unsloth/Qwen3-4B-Base --load_format dummy $common --capture_cudagraph \
          --n_prompts 64 --max_batch_size 64 --max_seq_length 1024 --n_pages 1024 --max_new_tokens 128 --stats_path "$OUT/stats/qwen3_4b_b64_graph.json"
        ;;
      e2b)
        run gemma4_e2b_b64_graph $PY gemma4_flex_inference.py --load_format dummy $common --capture_cudagraph \
          --n_prompts 64 --max_batch_size 64 --max_seq_length 1024 --n_pages 1024 --max_new_tokens 128 --stats_path "$OUT/stats/gemma4_e2b_b64_graph.json"
        run gemma4_e2b_b1_graph $PY gemma4_flex_inference.py --load_format dummy $common --capture_cudagraph \
          --n_prompts 2 --max_batch_size 1 --max_seq_length 1024 --n_pages 64 --max_new_tokens 128 --stats_path "$OUT/stats/gemma4_e2b_b1_graph.json"
        run gemma4_e2b_b64_eager $PY gemma4_flex_inference.py --load_format dummy $common \
          --n_prompts 64 --max_batch_size 64 --max_seq_length 1024 --n_pages 1024 --max_new_tokens 128 --stats_path "$OUT/stats/gemma4_e2b_b64_eager.json"
        ;;
      flex_decode)
        run flex_decode_options $PY -m scripts.benchmarks.flex_kernel_options --skip_prefill --out "$OUT/flex_decode_options.json" ;;
      attention)
        run decode_attention $PY -m scripts.benchmarks.bench_decode_attention --batch_sizes 1 8 64 256 \
          --out "$OUT/decode_attention.json" ;;
      attention_tiles)
        run attention_tiles $PY -m scripts.benchmarks.bench_decode_attention --kinds e2b_full e2b_sliding \
          --batch_sizes 64 256 --tiles --out "$OUT/attention_tiles.json" ;;
      rollouts_targets)
        run rollouts_targets $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 256 64 1 --systems engine_fused_compiled_graph \
          --profile --out "$OUT/rollouts_targets.json" ;;
      rollouts_quick)
        run rollouts_quick $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 64 1 --systems engine_fused_compiled_graph \
          --profile --out "$OUT/rollouts_quick.json" ;;
      sampling)
        run sampling_step $PY -m scripts.benchmarks.bench_sampling_step --out "$OUT/sampling_step.json"
        run rollouts_sampling $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 64 256 \
          --systems engine_fused_compiled_graph engine_fused_compiled_graph_sample engine_fused_compiled_graph_top_p \
          --out "$OUT/rollouts_sampling.json" ;;
      grpo)
        run grpo $PY -m scripts.benchmarks.bench_grpo --out "$OUT/grpo.json" ;;
      rollouts_rest)
        run rollouts_b8 $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 8 --systems engine_fused_compiled_graph --out "$OUT/rollouts_b8.json"
        run rollouts_cublas_b1 $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 1 --systems engine_fused_compiled_graph_cublas \
          --out "$OUT/rollouts_cublas_b1.json"
        run rollouts_hf_quick $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 64 1 --systems hf_cb hf_dynamic --out "$OUT/rollouts_hf.json" ;;
      gemv)
        run gemv $PY -m scripts.benchmarks.bench_gemv --out "$OUT/gemv.json" ;;
      gemv_sweep)
        run gemv_sweep $PY -m scripts.benchmarks.bench_gemv --num_rows 64 32 --sweep --out "$OUT/gemv_sweep.json" ;;
      profile)
        run profile_decode $PY -m scripts.benchmarks.profile_decode --batch_sizes 1 64 --out "$OUT/profile_decode.json" ;;
      rollouts)
        run rollouts $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 64 8 1 --systems engine_fused_compiled_graph engine_graph \
          --profile --out "$OUT/rollouts.json" ;;
      rollouts_ablation)
        run rollouts_ablation $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 64 8 1 --systems engine_compiled_graph engine_eager \
          --out "$OUT/rollouts_ablation.json" ;;
      rollouts_qwen3)
        run rollouts_qwen3 $PY -m scripts.benchmarks.bench_rollouts --preset unsloth__Qwen3-4B-Base --batch_sizes 64 \
          --systems engine_fused_compiled_graph engine_graph --out "$OUT/rollouts_qwen3.json" ;;
      rollouts_hf)
        run rollouts_hf $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 64 8 1 --systems hf_cb hf_dynamic --out "$OUT/rollouts_hf.json" ;;
      rollouts_hf_compile)
        run rollouts_hf_compile $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 64 8 1 --systems hf_static_compile \
          --hf_compile_mode "${HF_COMPILE_MODE:-reduce-overhead}" --out "$OUT/rollouts_hf_compile.json" ;;
      trl)
        grpo="--device cuda --dtype bfloat16 --num_prompts 8 --num_generations 8 --max_completion_length 256"
        e2b="--model_name unsloth/gemma-4-E2B-it --load_format dummy --tokenizer $tiny/gemma4"
        run trl_tiny_gemma4_logprobs $PY -m scripts.grpo_trl --model_name $tiny/gemma4 $grpo $on_copy --steps 3 --compare_logprobs \
          --out "$OUT/trl_tiny_gemma4_logprobs.json"
        run trl_e2b_logprobs $PY -m scripts.grpo_trl $e2b $grpo $on_copy --steps 2 --compare_logprobs --out "$OUT/trl_e2b_logprobs.json"
        run trl_e2b_engine $PY -m scripts.grpo_trl $e2b $grpo $on_copy --steps 4 --out "$OUT/trl_e2b_engine.json"
        run trl_e2b_hf $PY -m scripts.grpo_trl $e2b $grpo --backend hf --steps 4 --out "$OUT/trl_e2b_hf.json" ;;
      zero_copy)
        [ -n "${ZERO_COPY_SKIP_TESTS:-}" ] || run gpu_tests_zero_copy $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -k zero_copy
        grpo="--device cuda --dtype bfloat16 --num_prompts 8 --num_generations 8 --max_completion_length 256 --steps ${ZERO_COPY_STEPS:-4} ${ZERO_COPY_ARGS:-}"
        e2b="--model_name unsloth/gemma-4-E2B-it --load_format dummy --tokenizer $tiny/gemma4 --lora_r ${LORA_R:-16}"
        for kind in ${ZERO_COPY_RUNS:-zero_copy_fused zero_copy copy hf}; do
          if [ "$kind" = bench ]; then
            run zero_copy_bench_r${LORA_R:-16} $PY -m scripts.benchmarks.bench_zero_copy --lora_r ${LORA_R:-16} \
              --out "$OUT/zero_copy_bench_r${LORA_R:-16}.json"
            continue
          fi
          case $kind in
            zero_copy) options="--capture_cudagraph --compile_decode --engine_weights shared --enable_sleep_mode" ;;
            zero_copy_fused) options="$fastest --engine_weights shared --enable_sleep_mode" ;;
            copy) options="$on_copy" ;;
            hf) options="--backend hf" ;;
          esac
          run trl_e2b_${kind}_r${LORA_R:-16} $PY -m scripts.grpo_trl $e2b $grpo $options --out "$OUT/trl_e2b_${kind}_r${LORA_R:-16}.json"
        done ;;
      startup)  # start-up to the 256 bucket, fastest mode: a process on empty caches, then one on the caches it left
        # every cache under one root (inductor's, Triton's for the project's own kernels, the race picks), packed into
        # $OUT/startup_cache.tar.xz.* with the cold process's torch mega-cache for startup_carried on a fresh machine
        root=/tmp/startup
        rm -rf $root && mkdir -p $root
        for cache in cold warm; do
          saving=""; [ $cache = cold ] && saving="--save_compile_artifacts $root/artifacts.bin"
          with_caches $root run startup_$cache $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 256 --new_tokens 64 \
            --systems engine_fused_compiled_graph $saving --out "$OUT/startup_$cache.json"
        done
        du -sh $root/*
        tar -C $root -c . | xz -T0 -6 | split -b 15M - "$OUT/startup_cache.tar.xz."
        ls -l "$OUT"/startup_cache.tar.xz.* ;;
      startup_carried)  # start-up on a fresh machine with what startup packed (carry .whl/startup_cache): its torch
        # mega-cache alone (and the race picks) on empty folders, then all its cache folders; STARTUP_COLD=1: first on none.
        # Unpacked where startup packed them: Triton's cache entries name their files by absolute path.
        root=/tmp/startup
        rm -rf $root /tmp/fresh && mkdir -p $root /tmp/fresh
        cat .whl/startup_cache/startup_cache.tar.xz.* | xz -d | tar -C $root -x
        if [ -n "${STARTUP_COLD:-}" ]; then
          with_caches /tmp/fresh/cold run startup_fresh_cold $PY -m scripts.benchmarks.bench_rollouts \
            --batch_sizes 256 --new_tokens 64 --systems engine_fused_compiled_graph --out "$OUT/startup_fresh_cold.json"
        fi
        TORCHINDUCTOR_CACHE_DIR=/tmp/fresh/inductor TRITON_CACHE_DIR=/tmp/fresh/triton FLEX_INFERENCE_CACHE_DIR=$root/flex \
          run startup_artifacts $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 256 --new_tokens 64 \
          --systems engine_fused_compiled_graph --load_compile_artifacts $root/artifacts.bin --out "$OUT/startup_artifacts.json"
        with_caches $root run startup_folders $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 256 --new_tokens 64 \
          --systems engine_fused_compiled_graph --out "$OUT/startup_folders.json" ;;
      startup_trees)  # cold start-up to the 256 bucket of this tree, then of each tree in $STARTUP_TREES (copies
        # of other commits carried under .whl, e.g. `mkdir -p .whl/B && git archive B | tar -x -C .whl/B`), each on empty caches of its own
        out_dir=$(realpath "$OUT")
        for tree in . ${STARTUP_TREES:-}; do
          name=this; [ "$tree" = . ] || name=$(basename "$tree")
          root=/tmp/startup_trees/$name
          rm -rf $root && mkdir -p $root
          (cd "$tree" && $PY scripts/make_tiny_checkpoints.py > /dev/null && with_caches $root run startup_tree_$name \
            $PY -m scripts.benchmarks.bench_rollouts --batch_sizes 256 --new_tokens 64 --systems engine_fused_compiled_graph \
            --out "$out_dir/startup_tree_$name.json")
        done ;;
      lever_bounds)  # decode step time without the PLE blocks, without the split combine, and whole
        run lever_bounds $PY -m scripts.benchmarks.bench_lever_bounds --batch_sizes 1 64 256 --out "$OUT/lever_bounds.json" ;;
      card)  # the largest GRPO batch on a smaller card, simulated (--gpu_memory_gb), each backend
        card_gb=${CARD_GB:-24}
        mkdir -p out/card
        grpo="--device cuda --dtype bfloat16 --num_generations 8 --max_completion_length 256 --steps 2 --micro_batch_size 8"
        grpo="$grpo --gradient_checkpointing --gpu_memory_gb $card_gb"
        e2b="--model_name unsloth/gemma-4-E2B-it --load_format dummy --tokenizer $tiny/gemma4 --lora_r 16"
        for kind in ${CARD_RUNS:-zero_copy hf copy}; do
          case $kind in  # where each search starts (prompts of 8 completions): where it is expected to end
            zero_copy) start=64 options="--capture_cudagraph --compile_decode --engine_weights shared --enable_sleep_mode --kv_cache_gb 1.5" ;;
            copy) start=8 options="$on_copy --kv_cache_gb 1.5" ;;
            hf) start=64 options="--backend hf" ;;
          esac
          # num_prompts doubles while it fits and halves while it does not, within 1..64 (8 to 512 completions)
          fits=0 fails=128 num_prompts=$start
          while [ "$num_prompts" -ge 1 ] && [ "$num_prompts" -le 64 ] && [ "$num_prompts" -lt "$fails" ] && [ "$num_prompts" -gt "$fits" ]; do
            name=${kind}_$((num_prompts * 8))
            if [ -f "out/card/$name.json" ] || grep -qs "out of GPU memory" "out/card/$name.err"; then
              echo "== card $name: done by an earlier call on this machine"; [ -f "out/card/$name.json" ]; status=$?
            else
              run card_$name $PY -m scripts.grpo_trl $e2b $grpo $options --num_prompts "$num_prompts" --out "out/card/$name.json" \
                2> "out/card/$name.err"
              status=$?
            fi
            tail -n 3 "out/card/$name.err"
            if [ $status -eq 0 ]; then
              fits=$num_prompts num_prompts=$((num_prompts * 2))
            elif grep -q "out of GPU memory" "out/card/$name.err"; then
              fails=$num_prompts num_prompts=$((num_prompts / 2))
            else
              echo "== card $kind: $name failed, not for memory: the search stops"; break
            fi
            $PY - "$OUT/card_${card_gb}gb.json" <<'PYEOF'
import json, pathlib, sys
runs = {}
for path in sorted(pathlib.Path("out/card").glob("*.err")):
    report = path.with_suffix(".json")
    errors = [line for line in path.read_text().splitlines() if line.startswith("error:")]
    runs[path.stem] = json.loads(report.read_text()) if report.exists() else {"error": errors[-1] if errors else None}
pathlib.Path(sys.argv[1]).write_text(json.dumps(runs, indent=1))
PYEOF
          done
          echo "== card ${card_gb} GB, $kind: the largest GRPO batch that fits is $((fits * 8)) completions (8 a prompt; 512 is the most tried)"
        done ;;
      fourbit)
        run gpu_tests_4bit $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -k 4bit
        system=engine_compiled_graph
        run rollouts_4bit $PY -m scripts.benchmarks.bench_rollouts --load_in_4bit --batch_sizes 1 64 --systems $system --profile \
          --out "$OUT/rollouts_4bit.json" || system=engine_graph  # the uncompiled step if bitsandbytes does not compile
        run rollouts_4bit_lora $PY -m scripts.benchmarks.bench_rollouts --load_in_4bit --lora_rank 16 --batch_sizes 1 64 \
          --systems $system --profile --out "$OUT/rollouts_4bit_lora.json" ;;
      trained)
        train_gpu_checkpoint
        cp checkpoints/trained_gpu/gemma4/REPORT.json "$OUT/trained_gpu_report.json"
        run fidelity $PY -m scripts.grpo_trl --model_name checkpoints/trained_gpu/gemma4 $learn $fastest --steps 3 \
          --engine_weights ${FIDELITY_WEIGHTS:-copy} --compare_logprobs --out "$OUT/fidelity_${FIDELITY_WEIGHTS:-copy}.json" ;;
      learning)
        train_gpu_checkpoint
        run learning $PY -m scripts.benchmarks.bench_learning --out_dir out/learning --runs ${LEARNING_RUNS:-engine hf} \
          --seeds ${LEARNING_SEEDS:-0 1 2} --bundle "$OUT/learning_${LEARNING_TAG:-all}.json" -- \
          --model_name checkpoints/trained_gpu/gemma4 $learn $on_copy --steps ${LEARNING_STEPS:-20} ;;
      multi_gpu)
        num_gpus=$(nvidia-smi -L | wc -l)
        for n in $(printf '%s\n' 1 "$num_gpus" | sort -un); do
          run gemma4_e2b_b64_graph_${n}gpu $PY -m torch.distributed.run --standalone --nproc_per_node "$n" gemma4_flex_inference.py \
            --load_format dummy $common --capture_cudagraph --n_prompts $((64 * n)) --max_batch_size 64 --max_seq_length 1024 --n_pages 1024 \
            --max_new_tokens 128 --stats_path "$OUT/stats/gemma4_e2b_b64_graph_${n}gpu.json"
        done ;;
    esac
  done
  # One file for all CLI stats (the device tool brings back at most 8 files).
  $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
stats = {p.stem: json.loads(p.read_text()) for p in sorted((out / "stats").glob("*.json"))}
if stats:
    (out / "cli_stats.json").write_text(json.dumps(stats, indent=1))
for name, s in stats.items():
    print(f"{name:28} {s['decode_tps_median']:10.0f} tok/s  decode steps {s['decode_step_tps']:8.0f} tok/s  prefill {s['prefill_tps']:8.0f} tok/s  median {s['median_wall_s']:7.2f} s  peak {s['peak_memory_gb']:6.2f} GB  capture {s.get('capture_s') or 0:5.1f} s  tokens {s['n_decoded_tokens']}")
# multi_gpu: total tok/s on N GPUs against 1 GPU.
tps_by_num_gpus = {s["world_size"]: s["decode_tps_median"] for name, s in stats.items() if name.startswith("gemma4_e2b_b64_graph_") and name.endswith("gpu")}
for n in sorted(tps_by_num_gpus)[1:]:
    print(f"data-parallel scaling, E2B batch 64 per GPU: {n} GPUs {tps_by_num_gpus[n]:.0f} tok/s = {tps_by_num_gpus[n] / tps_by_num_gpus[1]:.2f}x 1 GPU ({tps_by_num_gpus[1]:.0f} tok/s)")
PYEOF
  rm -rf "$OUT/stats"
} 2>&1 | tee "$OUT/gpu_check.log"
