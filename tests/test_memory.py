"""KV sizing from fake device stats: the numbers a user on an H100/H200/TPU chip would see."""

from __future__ import annotations

import pytest

from jaxserve.errors import UserError
from jaxserve.runtime import memory
from jaxserve.runtime.memory import DEFAULT_MARGIN as DEFAULT
from jaxserve.runtime.memory import GiB, plan_kv_memory


def block_bytes(layers, kv_heads, head_dim, block_size=16, dtype_bytes=2, tp=1):
    return 2 * layers * max(kv_heads // tp, 1) * head_dim * block_size * dtype_bytes


LLAMA_8B = {"weights": int(8.03e9 * 2), "block": block_bytes(32, 8, 128)}
LLAMA_70B = {"weights": int(70.6e9 * 2)}  # 80 layers, 8 kv heads, head_dim 128
LLAMA_1B = {"weights": int(1.24e9 * 2), "block": block_bytes(16, 8, 64)}


def check_plan(plan, *, limit, in_use, act, block, util=0.9):
    """Everything fits in the budget and no further block would."""
    budget = int(util * limit)
    used = in_use + act + plan.margin_bytes + plan.kv_bytes
    assert used <= budget < used + block
    assert plan.kv_bytes == plan.num_blocks * block
    assert plan.max_concurrency == plan.num_blocks * plan.block_size / plan.max_model_len


@pytest.mark.parametrize("limit_gib", [79.1, 139.8], ids=["h100-80g", "h200-141g"])
def test_8b_bf16_on_80_and_141_gib(limit_gib):
    limit, act = int(limit_gib * GiB), 3 * GiB
    in_use = LLAMA_8B["weights"] + (300 << 20)  # weights + runtime buffers
    plan = plan_kv_memory(device_limit=limit, bytes_in_use=in_use, activation_bytes=act,
                          block_bytes=LLAMA_8B["block"], block_size=16, max_model_len=8192)
    check_plan(plan, limit=limit, in_use=in_use, act=act, block=LLAMA_8B["block"])
    # 2 MiB per 16-token block (128 KiB/token): about 52 GiB -> 26.6k blocks on 80 GB.
    expected_gib = 0.9 * limit_gib - in_use / GiB - 3 - 0.25
    assert plan.kv_bytes / GiB == pytest.approx(expected_gib, abs=0.01)
    assert plan.max_concurrency > (50 if limit_gib > 100 else 25)
    line = memory.summary(plan)
    assert f"{plan.num_blocks} blocks" in line and "max concurrency" in line
    assert "weights 15." in line  # 16.06 GB + runtime buffers in GiB


def test_1b_on_a_16_gib_chip():
    limit, act = int(15.75 * GiB), 1 * GiB
    plan = plan_kv_memory(device_limit=limit, bytes_in_use=LLAMA_1B["weights"],
                          activation_bytes=act, block_bytes=LLAMA_1B["block"], block_size=16,
                          max_model_len=131072)
    check_plan(plan, limit=limit, in_use=LLAMA_1B["weights"], act=act, block=LLAMA_1B["block"])
    # 32 KiB/token: the ~10.6 GiB left holds about 2.65 requests of 128k tokens.
    assert 2.6 < plan.max_concurrency < 2.7


def test_70b_at_tp8_sizes_per_device():
    tp, limit, act = 8, int(79.1 * GiB), 2 * GiB
    block = block_bytes(80, 8, 128, tp=tp)  # one kv head per device
    in_use = LLAMA_70B["weights"] // tp
    plan = plan_kv_memory(device_limit=limit, bytes_in_use=in_use, activation_bytes=act,
                          block_bytes=block, block_size=16, max_model_len=32768,
                          tensor_parallel_size=tp)
    check_plan(plan, limit=limit, in_use=in_use, act=act, block=block)
    assert plan.block_bytes == 80 * 2 * 128 * 16 * 2
    assert "tp 8" in memory.summary(plan)


def test_70b_on_one_device_names_size_memory_and_tp():
    with pytest.raises(UserError) as err:
        plan_kv_memory(device_limit=int(79.1 * GiB), bytes_in_use=LLAMA_70B["weights"],
                       activation_bytes=2 * GiB, block_bytes=block_bytes(80, 8, 128),
                       block_size=16, max_model_len=8192)
    msg = str(err.value)
    assert "131.50 GiB" in msg and "79.10 GiB" in msg  # the model's size and the device's
    assert "--tensor-parallel-size" in msg and "--gpu-memory-utilization" in msg
    assert err.value.param == "gpu_memory_utilization"


def test_8b_on_a_16_gib_chip_does_not_fit():
    with pytest.raises(UserError, match="--tensor-parallel-size"):
        plan_kv_memory(device_limit=int(15.75 * GiB), bytes_in_use=LLAMA_8B["weights"],
                       activation_bytes=GiB, block_bytes=LLAMA_8B["block"], block_size=16,
                       max_model_len=4096)


def test_activations_too_large_name_the_batch_flags():
    with pytest.raises(UserError) as err:
        plan_kv_memory(device_limit=int(79.1 * GiB), bytes_in_use=LLAMA_8B["weights"],
                       activation_bytes=60 * GiB, block_bytes=LLAMA_8B["block"], block_size=16,
                       max_model_len=4096)
    msg = str(err.value)
    assert "--max-num-batched-tokens" in msg and "--max-num-seqs" in msg
    assert "60.00 GiB of temporaries" in msg


def test_max_model_len_longer_than_the_cache_suggests_a_length():
    in_use = LLAMA_8B["weights"]
    with pytest.raises(UserError) as err:
        plan_kv_memory(device_limit=int(24 * GiB), bytes_in_use=in_use, activation_bytes=GiB,
                       block_bytes=LLAMA_8B["block"], block_size=16, max_model_len=131072)
    assert err.value.param == "max_model_len"
    assert "--max-model-len" in str(err.value) and "131072" in str(err.value)


@pytest.mark.parametrize("util", [0.0, 1.5, -0.1])
def test_bad_utilization(util):
    with pytest.raises(UserError, match="--gpu-memory-utilization"):
        plan_kv_memory(device_limit=GiB, bytes_in_use=0, activation_bytes=0, block_bytes=1024,
                       block_size=16, max_model_len=16, utilization=util)


def test_utilization_scales_the_budget():
    block = LLAMA_8B["block"]
    kw = {"device_limit": int(79.1 * GiB), "bytes_in_use": LLAMA_8B["weights"],
          "activation_bytes": GiB, "block_bytes": block, "block_size": 16, "max_model_len": 4096}
    lo, hi = plan_kv_memory(**kw, utilization=0.5), plan_kv_memory(**kw, utilization=0.95)
    extra = int(0.45 * 79.1 * GiB) // block
    assert hi.num_blocks - lo.num_blocks in (extra - 1, extra, extra + 1)


def test_gpu_pool_is_sized_to_the_utilization_before_jax_starts():
    """jax's GPU pool is 75% of the device by default: without sizing it, 0.9 would plan with
    0.9 x 75%. Sized, an H200's 141 GiB at 0.9 gives a pool of 126.9 GiB and all of it is planned."""
    env: dict = {}
    assert memory.size_gpu_pool(0.9, env=env, started=False) == 0.9
    assert env == {"XLA_CLIENT_MEM_FRACTION": "0.9"}
    total = 141 * GiB
    pool = int(0.9 * total)
    assert memory.device_total(pool, "gpu", pool_fraction=0.9) == pytest.approx(total, abs=1)
    assert memory.device_total(pool, "tpu", pool_fraction=0.9) == pool  # TPU: the limit is the chip
    kw = {"bytes_in_use": LLAMA_8B["weights"], "activation_bytes": GiB, "block_bytes": LLAMA_8B["block"],
          "block_size": 16, "max_model_len": 8192}
    plan = plan_kv_memory(device_limit=memory.device_total(pool, "gpu", 0.9), allocator_limit=pool, **kw)
    check_plan(plan, limit=total, in_use=kw["bytes_in_use"], act=GiB, block=LLAMA_8B["block"])
    unsized = plan_kv_memory(device_limit=int(0.75 * total), **kw)  # what the default pool gave
    assert plan.kv_bytes - unsized.kv_bytes > 0.9 * 0.15 * total - LLAMA_8B["block"]
    # never past what the allocator can hand out (a later engine asking for more than the pool)
    big = plan_kv_memory(device_limit=total, allocator_limit=pool, **kw | {"block_bytes": LLAMA_8B["block"]},
                         utilization=0.99)
    assert big.kv_bytes <= pool - kw["bytes_in_use"] - GiB - big.margin_bytes


@pytest.mark.parametrize("env", [{"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, {"XLA_CLIENT_MEM_FRACTION": ".5"},
                                 {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}])
def test_gpu_pool_the_user_chose_is_kept(env):
    before = dict(env)
    assert memory.size_gpu_pool(0.9, env=env, started=False) is None
    assert env == before
    assert memory.size_gpu_pool(0.9, env={}, started=True) is None  # jax already started: too late


@pytest.mark.parametrize("user", [{}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, {"XLA_CLIENT_MEM_FRACTION": ".5"}])
def test_gpu_plugin_options_accept_the_sized_pool(monkeypatch, user):
    """jaxlib's own GPU plugin options, read after size_gpu_pool: they raise ValueError when both pool
    variables are set, and jax then starts without its GPU (what the engine did to itself)."""
    from jaxlib import xla_client

    for k in memory.POOL_FRACTION_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in user.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(memory, "_pool_fraction", None)
    memory.size_gpu_pool(0.9, started=False)
    options = xla_client.generate_pjrt_gpu_plugin_options()
    assert options["memory_fraction"] == (0.5 if user else 0.9)
    monkeypatch.setattr(memory, "_pool_fraction", None)


def test_device_memory_on_cpu_is_none():
    import jax

    assert memory.device_memory(jax.devices()[0]) is None


def test_reserved_null_block_is_not_counted_as_capacity():
    kw = {"device_limit": 4 * GiB, "bytes_in_use": GiB, "activation_bytes": 0,
          "block_bytes": 1 << 20, "block_size": 16, "max_model_len": 16}
    plain, reserved = plan_kv_memory(**kw), plan_kv_memory(**kw, reserved_blocks=1)
    assert plain.num_blocks == reserved.num_blocks
    assert reserved.kv_tokens == plain.kv_tokens - 16
    with pytest.raises(UserError):  # room for exactly the null block is no room at all
        plan_kv_memory(**{**kw, "device_limit": int((GiB + DEFAULT + (1 << 20)) / 0.9) + 1},
                       reserved_blocks=1)


def test_engine_sizes_kv_after_the_weights_and_the_compiled_step(tiny_model, monkeypatch):
    """On a device with memory stats (faked here), the engine places the weights and compiles the
    largest step before it sizes the KV cache from what is left."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.errors import UserError
    from jaxserve.runtime import kv_sizing

    limit, in_use = memory.DEFAULT_MARGIN + (48 << 20), 4 << 20
    monkeypatch.setattr(memory, "has_device_stats", lambda: True)
    monkeypatch.setattr(memory, "device_memory", lambda device: (limit, in_use))
    kw = dict(model=tiny_model("llama"), precompile=False, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, gpu_memory_utilization=1.0)
    engine = LLMEngine(EngineConfig(**kw))
    peak = engine.runner.peak_step_bytes()
    assert peak > 0
    block = kv_sizing.kv_bytes_per_block(engine.model_config, 16, str(engine.runner.kv_dtype))
    want = (limit - in_use - peak - memory.DEFAULT_MARGIN) // block
    assert engine.num_blocks == want == engine.runner.kv_caches[0][0].shape[0]
    assert engine.scheduler.kv.num_blocks == want
    from jaxserve import SamplingParams

    engine.add_request("a", None, SamplingParams(max_tokens=4, temperature=0), prompt_token_ids=[3, 4, 5])
    while engine.has_unfinished_requests():
        engine.step()
    monkeypatch.setattr(memory, "device_memory", lambda device: (limit, limit))  # weights fill it
    with pytest.raises(UserError, match="tensor-parallel-size"):
        LLMEngine(EngineConfig(**kw))


def test_map_count_warning_names_the_limit_and_the_fix():
    assert memory.map_count_warning(30_000, 65_530, 45) is None
    msg = memory.map_count_warning(40_000, 65_530, 100)
    assert "40000 of the 65530" in msg and "vm.max_map_count" in msg and "100 compiled steps" in msg


def test_memory_maps_reads_this_process():
    maps = memory.memory_maps()
    if maps is None:
        pytest.skip("no /proc here")
    held, limit = maps
    assert 0 < held < limit


def test_device_buckets_compile_before_the_kv_cache_is_allocated(tiny_model, monkeypatch):
    """Issue 24 item 6: on a device (stats faked) every bucket compiles against the planned cache's
    shapes while its memory is still free (XLA:GPU's autotuner allocates from the same pool), then
    the cache is allocated once; serving then compiles nothing and decodes as a host engine does."""
    from jaxserve import SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    import jax

    from jaxserve.worker import runner as rt

    events = []
    allocate, compile_ = rt.ModelRunner._allocate_kv, rt.ModelRunner._compile

    def record(self, n):  # real allocations only (kv_spec traces this under eval_shape: no memory)
        out = allocate(self, n)
        if not isinstance(jax.tree.leaves(out.layers)[0], jax.core.Tracer):
            events.append(("allocate", n))
        return out

    monkeypatch.setattr(rt.ModelRunner, "_allocate_kv", record)
    monkeypatch.setattr(rt.ModelRunner, "_compile",
                        lambda self, key: events.append(("compile", key)) or compile_(self, key))
    limit, in_use = memory.DEFAULT_MARGIN + (48 << 20), 4 << 20
    monkeypatch.setattr(memory, "has_device_stats", lambda: True)
    monkeypatch.setattr(memory, "device_memory", lambda device: (limit, in_use))
    kw = dict(model=tiny_model("llama"), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              gpu_memory_utilization=1.0)
    engine = LLMEngine(EngineConfig(**kw))
    n, buckets = engine.num_blocks, engine.runner.all_buckets()
    assert n > 2 and engine.runner.kv_caches[0][0].shape[0] == n
    assert [e for e in events if e[0] == "allocate"][-1] == ("allocate", n) == events[-1]  # allocated last
    assert sum(1 for e in events if e == ("allocate", n)) == 1  # once, not per layout or per compile
    compiles = [e[1] for e in events if e[0] == "compile"]  # the plan's largest step, then every bucket
    assert compiles[0] == max(buckets) and sorted(compiles[1:]) == sorted(buckets)
    assert engine.runner.num_compiles == len(buckets)

    def greedy(engine):
        engine.add_request("a", None, SamplingParams(max_tokens=6, temperature=0), prompt_token_ids=[3, 4, 5, 6])
        out = []
        while engine.has_unfinished_requests():
            out += [o for o in engine.step() if o.finished]
        return out[0].outputs[0].token_ids

    tokens = greedy(engine)
    assert engine.runner.num_compiles == len(buckets)  # nothing compiled while serving
    monkeypatch.setattr(memory, "has_device_stats", lambda: False)
    host = LLMEngine(EngineConfig(**kw, num_blocks=n, precompile=False))
    assert greedy(host) == tokens
