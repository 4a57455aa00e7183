"""Mixture-of-experts ops: routers (token -> top-k experts and weights) and the routed experts as a
grouped matmul, dropless.

`grouped_experts` sorts the T x k (token, expert) assignments by expert and runs each projection
as one `jax.lax.ragged_dot` over the expert groups, so every expert multiplies exactly the rows
routed to it (no capacity factor, nothing dropped, nothing computed for an expert with no tokens).
Rows that must not be computed - bucket padding past `num_rows`, and under expert parallelism the
assignments of experts another device holds - get the sentinel group E: sorted last, outside every
group, their output is zero. The combine un-sorts and sums each token's k rows with their weights
(a gather and a reduction, no scatter).

Four implementations of the grouped product, same signature as `jax.lax.ragged_dot`: XLA's own
(which XLA:GPU turns into one dense product over every expert), `pallas_ragged_dot` for TPU
(pallas_kernels/tpu_gmm.py, a megablox-class Pallas kernel: row tiles visited once per group they
hold, so a group's rows are multiplied by its expert only), `gpu_ragged_dot` for cuda (the same
visits in Mosaic GPU: pallas_kernels/gpu_gmm.py), and
`blocked_ragged_dot` for CPU, where `ragged_dot` is expanded into a
dense product over every expert (E x the FLOPs, and a masked [E, M, K] copy of the rows): there the
rows are laid out in tiles of B rows, each tile one expert's (groups padded to whole tiles, at most
M / B + min(E, M) tiles), and a loop multiplies each tile by its expert's matrix, read in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def route_softmax(logits, k: int, norm_topk_prob: bool):
    """Softmax over all experts, top k (ties: the lower expert id first, as `lax.top_k`), optionally
    renormalised over the k (Qwen3-MoE, Mixtral) or not (Qwen2-MoE).
    logits: f32[T, E] -> (weights f32[T, k], ids i32[T, k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def route_topk_softmax(logits, k: int):
    """gpt-oss routing: top k of the raw logits, softmaxed over those k."""
    top, ids = jax.lax.top_k(logits.astype(jnp.float32), k)
    return jax.nn.softmax(top, axis=-1), ids


def silu_gate(gate, up):
    return jax.nn.silu(gate) * up


def swiglu_clamp(alpha: float, limit: float):
    """gpt-oss's expert activation: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
    def act(gate, up):
        g = jnp.minimum(gate, limit)
        return (jnp.clip(up, -limit, limit) + 1) * g * jax.nn.sigmoid(g * alpha)

    return act


def expert_matrix(rhs, i, dtype):
    """Expert i's [K, N] matrix of a stacked [E, K, N] array, or decoded from a packed format
    (one with an `expert(i, dtype)` method: runtime/mxfp4.py) right where it is multiplied."""
    if hasattr(rhs, "expert"):
        return rhs.expert(i, dtype)
    return jax.lax.dynamic_index_in_dim(rhs, i, keepdims=False)


def route_sigmoid(logits, bias, k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scale: float):
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores; the choice adds a per-expert correction bias
    and keeps only the `topk_group` groups (of `n_group`) whose two best biased scores sum highest;
    the weights are the unbiased scores of the chosen experts, optionally renormalised, times
    `scale` (routed_scaling_factor). logits f32[T, E], bias f32[E]."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)[None, :]
    t, e = choice.shape
    if n_group > 1:
        groups = choice.reshape(t, n_group, e // n_group)
        group_score = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [T, n_group]
        _, keep = jax.lax.top_k(group_score, topk_group)
        mask = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(mask, e // n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, ids


def tile_rows(m: int, e: int) -> int:
    """Rows per tile for M rows over E experts: about the mean group size, so padding at most
    doubles the rows (1 when M <= E: no padding at all, decode's case)."""
    return max(1, -(-m // e))


def expert_product(x, rhs, i):
    """x @ expert i's matrix of rhs (stacked [E, K, N] or a packed format: `expert_matrix`)."""
    return x @ expert_matrix(rhs, i, x.dtype)


def blocked_ragged_dot(lhs, rhs, group_sizes, block: int | None = None, product=expert_product):
    """`jax.lax.ragged_dot` as tiles: lhs [M, K] rows sorted by group, rhs [E, K, N], group_sizes
    i32[E] (summing to at most M; rows past the sum come out zero) -> [M, N]. `product(tile, rhs, i)`:
    a tile of rows times expert i (a weight format's own product: runtime/expert_matmul.py)."""
    m, e = lhs.shape[0], rhs.shape[0]
    b = block or tile_rows(m, e)
    tiles = (m + min(e, m) * (b - 1)) // b  # an upper bound on sum(ceil(size / b))
    sizes = group_sizes.astype(jnp.int32)
    per_group = (sizes + b - 1) // b
    tile_end = jnp.cumsum(per_group)
    row_end = jnp.cumsum(sizes)
    r = jnp.arange(m)
    g = jnp.searchsorted(row_end, r, side="right")  # each row's group; e past the last
    gc = jnp.minimum(g, e - 1)
    pos = (tile_end[gc] - per_group[gc]) * b + r - (row_end[gc] - sizes[gc])
    pos = jnp.where(g < e, pos, tiles * b)  # out of range: dropped
    x = jnp.zeros((tiles * b, lhs.shape[1]), lhs.dtype).at[pos].set(lhs, mode="drop")
    expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(tiles), side="right"), e - 1)
    # one tile at a time: each reads its expert's matrix in place (a gathered [tiles, K, N] copy of
    # the weights is ~20x slower on XLA:CPU)
    y = jax.lax.map(lambda a: product(a[0], rhs, a[1]),
                    (x.reshape(tiles, b, -1), expert)).reshape(tiles * b, -1)
    return jnp.where((g < e)[:, None], y[jnp.minimum(pos, tiles * b - 1)], 0).astype(lhs.dtype)


def pallas_ragged_dot(lhs, rhs, group_sizes, *, group_rows: int | None = None, interpret: bool = False):
    """The TPU backend's grouped product: the Pallas kernel (pallas_kernels/tpu_gmm.py) over float
    experts, rows past sum(group_sizes) left unwritten (`grouped_experts` zeroes its sentinel rows
    itself, so no grid step touches them: under expert parallelism most rows are another device's);
    a packed expert format (an `expert(i, dtype)` method: runtime/mxfp4.py) goes to the blocked
    product, which decodes one expert's matrix per tile. ``group_rows``: the rows an expert is
    expected to hold, which sizes the row tiles (`grouped_experts` passes it under expert
    parallelism); ``interpret``: Pallas' TPU interpreter (tests, on CPU)."""
    if hasattr(rhs, "expert"):
        return blocked_ragged_dot(lhs, rhs, group_sizes)
    from pallas_kernels import tpu_gmm

    return tpu_gmm.gmm(lhs, rhs, group_sizes, zero_rest=False, group_rows=group_rows, interpret=interpret)


def gpu_ragged_dot(lhs, rhs, group_sizes, *, interpret: bool = False):
    """The cuda backend's grouped product: the Mosaic GPU kernel (pallas_kernels/gpu_gmm.py) over
    bf16/f16 experts, rows past sum(group_sizes) left unwritten (as `pallas_ragged_dot`); XLA:GPU's
    `ragged_dot` would multiply every row by every expert (a [M, E*K] operand). Operands the kernel
    does not take (`gpu_gmm.unsupported`: f32, mixed dtypes, K or N not a multiple of 16) go to
    `jax.lax.ragged_dot`, packed experts to the blocked product. The kernel's row tile does not
    depend on the expert count, so it needs no ``group_rows`` under expert parallelism."""
    if hasattr(rhs, "expert"):
        return blocked_ragged_dot(lhs, rhs, group_sizes)
    from pallas_kernels import gpu_gmm

    if gpu_gmm.unsupported(lhs.shape[1], rhs.shape[2], lhs.dtype, rhs.dtype):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    return gpu_gmm.gmm(lhs, rhs, group_sizes, zero_rest=False, interpret=interpret)


def gpu_kernel_takes(hidden: int, inter: int, dtype) -> bool:
    """Whether `gpu_ragged_dot` runs the kernel, not XLA's ragged_dot, on [E, hidden, inter] and
    [E, inter, hidden] experts of ``dtype`` (`jaxserve lower`'s memory estimate asks)."""
    from pallas_kernels import gpu_gmm

    return not any(gpu_gmm.unsupported(k, n, dtype, dtype) for k, n in ((hidden, inter), (inter, hidden)))


def xla_gpu_dense_experts(platform: str, mc, tp: int, gpu_moe_kernel: bool, dtype) -> int:
    """Experts per device whose product XLA:GPU expands densely (it rewrites `jax.lax.ragged_dot`
    into a product over every expert), 0 where the Mosaic GPU grouped matmul runs them or off cuda:
    for `jaxserve lower`'s memory estimate (packed experts, taking the blocked product, are the
    caller's 0). `mc` is the model config as sharded."""
    inter = mc.moe_intermediate_size if mc.expert_parallel else mc.moe_intermediate_size // max(tp, 1)
    if platform != "cuda" or not mc.is_moe or (gpu_moe_kernel and gpu_kernel_takes(mc.hidden_size, inter, dtype)):
        return 0
    return mc.num_experts // tp if mc.expert_parallel else mc.num_experts


def grouped_experts(x, ids, weights, w_gate, w_up, w_down, num_rows=None, expert_offset=0,
                    matmul=jax.lax.ragged_dot, *, biases=None, act=silu_gate, gated=None, num_experts=None,
                    rows=None):
    """sum_j weights[t, j] * FFN_{ids[t, j]}(x[t]) for every token t, FFN_e(x) = act(x Wg_e, x Wu_e) Wd_e
    (act silu(g) * u unless given; `biases` (b_gate, b_up) [E, I] add to x Wg_e and x Wu_e; a down
    bias is the caller's: sum_j weights * b_down[ids] needs no grouped product).

    x: [T, H]; ids: i32[T, k] (global expert ids); weights: f32[T, k];
    w_gate / w_up: [E, H, I]; w_down: [E, I, H] - the E experts this device holds, global ids
    expert_offset .. expert_offset + E - 1 (expert parallelism; 0 otherwise);
    num_rows: i32[1] real tokens (rows past them are never routed); matmul: `jax.lax.ragged_dot`,
    `pallas_ragged_dot` or `blocked_ragged_dot` (rows past sum(sizes) may come out as anything: they
    are zeroed here), or a weight format's grouped product (runtime/expert_matmul.py); a packed
    expert format (runtime/mxfp4.py) given `ragged_dot` goes through the blocked product, which decodes
    one expert's matrix per tile; `gated(rows, w_gate, w_up, sizes)`: silu(rows Wg) * (rows Wu) in one
    product, used for the default act without biases; `num_experts`: every device's experts together
    (expert parallelism: sizes `pallas_ragged_dot`'s row tiles for the T*k/num_experts rows an expert
    gets, not the T*k/E rows, mostly other devices', it is given); `rows`: (route, gather, combine)
    in place of XLA's sort, gathers and einsum (runtime/expert_matmul.py's native ones, for float32
    and a matmul whose rows past sum(sizes) are zero): route(group, e) = (order, sizes) below,
    gather(x, order) = x[order // k], combine(y, order, w) = the einsum below of y in (token, slot)
    order; with `rows`, `gated` takes the unsorted x and the order, gated(x, w_gate, w_up, sizes,
    order) = gated(gather(x, order), w_gate, w_up, sizes) (the native call reads the rows in place:
    no gathered copy). -> [T, H] in x's dtype."""
    t, k = ids.shape
    e = w_gate.shape[0]
    local = ids - expert_offset
    valid = (local >= 0) & (local < e)
    if num_rows is not None:
        valid &= (jnp.arange(t) < num_rows[0])[:, None]
    group = jnp.where(valid, local, e).reshape(-1)  # [T*k], sentinel e: not computed
    if rows:
        order, sizes = rows[0](group, e)
    else:
        order = jnp.argsort(group, stable=True)
        sizes = jnp.zeros((e + 1,), jnp.int32).at[group].add(1)[:e]
    packed = hasattr(w_gate, "expert")
    dot = blocked_ragged_dot if packed and matmul is jax.lax.ragged_dot else matmul
    if num_experts and getattr(matmul, "func", matmul) is pallas_ragged_dot:  # a partial (tests: interpret)
        dot = functools.partial(dot, group_rows=-(-t * k // num_experts))
    dtype = x.dtype if packed else w_gate.dtype
    if gated is not None and act is silu_gate and biases is None:
        h = gated(x, w_gate, w_up, sizes, order) if rows else gated(x[order // k].astype(dtype), w_gate, w_up, sizes)
    else:
        xs = rows[1](x, order) if rows else x[order // k].astype(dtype)  # [T*k, H] rows grouped by expert
        g, u = dot(xs, w_gate, sizes), dot(xs, w_up, sizes)
        if biases is not None:
            row_expert = jnp.minimum(group[order], e - 1)
            g, u = g + biases[0][row_expert].astype(g.dtype), u + biases[1][row_expert].astype(u.dtype)
        h = act(g, u)
    y = dot(h.astype(dtype), w_down, sizes)  # [T*k, H]
    w = jnp.where(valid, weights, 0).astype(jnp.float32)
    if rows:
        return rows[2](y, order, w).astype(x.dtype)
    y = jnp.where(group[order][:, None] < e, y, 0)  # rows outside every group: exactly zero
    y = y[jnp.argsort(order)].reshape(t, k, -1)  # back to (token, slot) order
    return jnp.einsum("tkh,tk->th", y.astype(jnp.float32), w).astype(x.dtype)
