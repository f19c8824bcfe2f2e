"""Shared fixtures. SmolLM2 (ours and HF's) loads once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Four host devices, for the tensor- and expert-parallel tests; everything else runs on the
# first one, as on a one-device machine.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import tempfile

# Every cache the code under test writes goes under one temporary folder per test run, never the
# home directory: the native kernels' build cache, the measured host peaks and JAX's persistent
# compilation cache (subprocesses inherit the variables).
_RUN_CACHE = tempfile.mkdtemp(prefix="research-tests-")
os.environ.setdefault("RESEARCH_NATIVE_CACHE", os.path.join(_RUN_CACHE, "native"))
os.environ.setdefault("RESEARCH_HOST_PEAKS_CACHE", os.path.join(_RUN_CACHE, "host_peaks.json"))
os.environ.setdefault("RESEARCH_JAX_CACHE_DIR", os.path.join(_RUN_CACHE, "jax"))

import pytest  # noqa: E402 (after the environment the code reads at import)
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run and machine (no example database).
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# JAX options a test may switch on (the persistent compilation cache) and that must not leak
# into the tests after it.
_JAX_OPTIONS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


# The slow tier (``make test-slow``; CI runs it after ``make test``): tests measured at 7 s or
# more each on a 2-core machine with cold caches (``pytest --durations``), long end-to-end runs
# on real weights, statistical samplers and multi-process runs. Each property keeps a cheaper
# check in the fast tier (tiny models, fewer prompts, one configuration) except where noted in
# the test itself. Node ids, parameters included.
SLOW_TESTS = {
    "tests/test_engine_smollm2.py::test_batch_invariance_32_prompts",
    "tests/test_ragged_attention.py::test_engine_greedy_tokens_with_pallas_equal_xla_on_mixed_steps",
    "tests/test_precompile.py::test_speculative_serving_on_covers_never_compiles_a_verification_in_a_step",
    "tests/test_experiments.py::test_real_tensor_parallel_and_replicas_run_from_hydra[hardware.num_replicas=2-ours-x2]",
    "tests/test_native_gemm.py::test_smollm2_bf16_through_the_kernel_matches_xla",
    "tests/test_native_gemm.py::test_avx2_and_sse_builds_give_the_same_bits[x86-64-v2]",
    "tests/test_native_gemm.py::test_avx2_and_sse_builds_give_the_same_bits[x86-64-v4]",
    "tests/test_native_gemm.py::test_avx2_and_sse_builds_give_the_same_bits[alderlake]",
    "tests/test_gguf_blocks.py::test_smollm2_as_stored_blocks_decodes_as_its_dequantized_twin",
    "tests/test_gguf_blocks.py::test_smollm2_awq_through_the_block_kernel_decodes_as_xla_dequantizing",
    "tests/test_gguf_blocks.py::test_smollm2_int8_activations_stay_within_a_kl_bound_of_float_activations",
    "tests/test_serve_text.py::test_streamed_text_equals_the_non_streamed_text_for_every_stop_string",
    "tests/test_speculative.py::test_smollm2_greedy_outputs_identical_with_ngram_speculation",
    "tests/test_engine_smollm2.py::test_memory_pressure_preempts_and_loses_nothing",
    "tests/test_native_attention.py::test_smollm2_greedy_native_equals_xla",
    "tests/test_parallel.py::test_smollm2_tensor_parallel_3_matches_one_device",
    "tests/test_router.py::test_two_replica_processes_behind_the_router_lose_nothing",
    "tests/test_speculative.py::test_speculation_under_memory_pressure_loses_nothing[ngram]",
    "tests/test_speculative.py::test_speculation_under_memory_pressure_loses_nothing[draft_model]",
    "tests/test_precompile.py::test_serving_on_covers_never_compiles_in_a_step_and_keeps_the_tokens",
    "tests/test_ragged_step.py::test_persistent_input_batch_equals_a_fresh_build_every_step",
    "tests/test_ragged_step.py::test_every_step_is_one_forward_pass_whatever_the_mix[spec1]",
    "tests/test_quantized_smollm2.py::test_pallas_interpret_backend_matches_xla_greedy",
    "tests/test_gpt_oss.py::test_pallas_backend_serves_gpt_oss_like_xla",
    "tests/test_engine_smollm2.py::test_isolation_nan_pool_matches_clean_run",
    "tests/test_quantized_smollm2.py::test_pallas_interpret_with_int4_kv_matches_xla",
    "tests/test_speculative.py::test_greedy_outputs_identical_with_ngram_speculation",
    "tests/test_ragged_step.py::test_greedy_tokens_do_not_depend_on_the_batch",
    "tests/test_engine.py::test_narrow_kv_pages_are_written_in_place_and_never_read_unwritten[fp8]",
    "tests/test_engine.py::test_narrow_kv_pages_are_written_in_place_and_never_read_unwritten[auto]",
    "tests/test_quantized_smollm2.py::test_quantized_weights_through_the_kernels_match_xla[tiny-qwen3-moe-nvfp4]",
    "tests/test_quantized_smollm2.py::test_quantized_weights_through_the_kernels_match_xla[tiny-llama-awq]",
    "tests/test_quantized_smollm2.py::test_quantized_weights_through_the_kernels_match_xla[tiny-qwen3-moe-fp8]",
    "tests/test_precompile.py::test_predicted_shapes_are_the_runs_and_nothing_compiles_inside_it[pool that forces preemption]",
    "tests/test_distributed.py::test_two_processes_match_one",
    "tests/test_serve.py::test_a_burst_beyond_the_queue_bound_gets_429s_and_the_admitted_complete",
    "tests/test_precompile.py::test_a_second_start_reads_compiled_steps_from_the_persistent_cache",
    "tests/test_experiments.py::test_real_tensor_parallel_and_replicas_run_from_hydra[hardware.tensor_parallel_size=2-ours-tp2]",
    "tests/test_serve.py::test_logprobs_through_the_openai_client",
    "tests/test_serve.py::test_chat_streams_as_vllm_bench_serve_openai_chat_sends_them",
    "tests/test_speculative.py::test_llm_accepts_vllms_speculative_config",
    "tests/test_experiments.py::test_preemptions_are_said",
    "tests/test_serve.py::test_a_peer_server_and_ours_in_one_comparison",
    "tests/test_speculative.py::test_engine_speculation_samples_the_target_distribution[ngram]",
    "tests/test_speculative.py::test_sampled_speculation_stops_and_logprob_requests_decode_plainly",
    "tests/test_quantized_smollm2.py::test_quantized_weights_stay_within_a_kl_bound[mxfp4]",
    "tests/test_quantized_smollm2.py::test_quantized_weights_stay_within_a_kl_bound[nvfp4]",
    "tests/test_quantized_smollm2.py::test_quantized_weights_stay_within_a_kl_bound[awq]",
    "tests/test_quantized_smollm2.py::test_quantized_kv_cache_stays_within_a_logprob_bound[fp8]",
    "tests/test_quantized_smollm2.py::test_quantized_weights_through_the_kernels_match_xla[tiny-llama-mxfp4]",
    "tests/test_native_attention.py::test_engine_greedy_native_equals_xla_under_preemption",
    "tests/test_precompile.py::test_predicted_shapes_are_the_runs_and_nothing_compiles_inside_it[roomy pool]",
    "tests/test_serve.py::test_64_concurrent_streams_complete_with_their_token_counts",
    "tests/test_gpt_oss.py::test_greedy_generation_matches_hf[16]",
    "tests/test_serve.py::test_completions_prompt_logprobs_as_vllm",
    "tests/test_parallel.py::test_fp8_weights_split_with_their_scales",
    "tests/test_parity_smollm2.py::test_logprobs_do_not_change_tokens",
    "tests/test_engine_smollm2.py::test_prefix_caching_hits_and_matches_uncached",
    "tests/test_quantized_smollm2.py::test_quantized_kv_cache_stays_within_a_logprob_bound[int4]",
    "tests/test_speculative.py::test_draft_model_greedy_outputs_identical",
    "tests/test_ragged_step.py::test_every_step_is_one_forward_pass_whatever_the_mix[None]",
    "tests/test_parity_smollm2.py::test_chat_answers_paris",
}


def pytest_collection_modifyitems(config, items):
    """Marks ``SLOW_TESTS`` slow; a listed test that no longer exists is an error (the list
    would silently stop moving it)."""
    found = set()
    for item in items:
        if item.nodeid in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
            found.add(item.nodeid)
    # Only a whole-suite collection can tell a stale entry from a deselected one.
    whole = config.args in ([], ["tests"]) and not config.getoption("keyword")
    if whole and (stale := SLOW_TESTS - found):
        raise pytest.UsageError(f"SLOW_TESTS names tests that do not exist: {sorted(stale)}")


def pytest_sessionstart(session):
    """``RESEARCH_REQUIRE_NATIVE=1`` (CI): a native kernel family that does not build fails the
    run instead of skipping its tests and leaving the engine on the XLA path unnoticed."""
    if os.environ.get("RESEARCH_REQUIRE_NATIVE") != "1":
        return
    import platform

    from research import native

    families = ["attention"] + (["gemm"] if platform.machine() in ("x86_64", "AMD64") else [])
    failed = {f: native.build_error(f) for f in families if not native.available(f)}
    if failed:
        pytest.exit(
            "RESEARCH_REQUIRE_NATIVE=1 and native kernels did not build: "
            + "; ".join(f"{f}: {e}" for f, e in failed.items()),
            returncode=1,
        )


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count, after pytest's own list."""
    from collections import Counter

    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_line(
            f"skipped {sum(reasons.values())}: "
            + "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common())
        )


@pytest.fixture(scope="session")
def smollm2_llm():
    from research import LLM

    return LLM("smollm2-135m", max_model_len=1024, dtype="float32")  # as the HF oracle


@pytest.fixture(scope="session")
def smollm2_hf():
    """HF transformers' model and tokenizer read from the same GGUF file (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from research.models.weights import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_executables():
    """Drop JAX's compiled executables after each module. XLA:CPU maps a few memory regions per
    executable and the kernel caps a process at vm.max_map_count (65,530 by default) mappings:
    the whole suite in one process compiles enough step shapes to reach it, and LLVM's JIT then
    crashes (SIGSEGV) inside the next compile. Shapes a module needs again recompile."""
    import jax

    before = {name: getattr(jax.config, name) for name in _JAX_OPTIONS}
    yield
    import gc

    for name, value in before.items():
        if getattr(jax.config, name) != value:
            jax.config.update(name, value)
            from jax._src import compilation_cache

            compilation_cache.reset_cache()
    jax.clear_caches()
    gc.collect()
