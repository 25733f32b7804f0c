"""The fused decode step: one token for each running row, from a BloomModel's weights, in a few large kernels.

A decode step of the model's own forward (the "unfused" path) runs ~19 kernels per block at batch 1, most of
them latency-bound (LayerNorm, bias, GeLU, residual add, KV-cache index writes, a materialised ALiBi bias). This
step runs the same maths as straight-line torch code split at the attention into segments that torch.compile
can fuse (the LayerNorm with the residual add before it, the bias with GeLU, each bias and residual into its
GEMM's epilogue where inductor picks a template for M <= 64):

    head    tokens -> embedding -> embedding LayerNorm -> block 0's input LayerNorm -> QKV GEMM     (B, 3H)
    mid_i   block i's dense GEMM + residual -> LayerNorm -> h->4h GEMM + GeLU -> 4h->h GEMM + residual
            -> block i+1's input LayerNorm -> QKV GEMM                                               (B, 3H)
    tail    the last block's rest -> final LayerNorm -> tied LM head -> fp32 logits, padding ids -inf (B, V)

and between them `decode_attention`, one kernel per layer (Triton on CUDA) that writes the new key and value
into the static cache at each row's own position and attends over that row's own keys 0..pos[b] only (no
padding to the longest row, no bias tensor): softmax(q k^T * scale + slope_h * (j - pos)) v, in fp32.

Rows are indirect: row b of the step decodes cache slot slots[b], so the engine packs its running rows into
the first n rows (the batch bucket follows the number of running rows, not the highest slot in use); padding
rows of a bucket point at a scratch slot nobody owns. All shapes are fixed per batch bucket (the kernel's loop
bound is read from the device), so one CUDA graph per bucket serves every length, with or without compile.

gemm="triton"/"auto": the segments' GEMMs may run megatron/inference/skinny_gemm.py's split-K kernel instead of
torch's (a custom op, opaque to inductor, with the bias, GeLU and residual add in its epilogue, and the
LayerNorm before the QKV, h->4h and LM head GEMMs in its prologue, so none of them is a launch of its own); a plan per
GEMM and batch bucket (qkv, dense, h->4h, 4h->h, LM head), None where torch's matmul (after its LayerNorm) timed
faster.
"""
import logging

import torch
import torch.nn.functional as F

from megatron.inference.skinny_gemm import GEMV_ROWS, MAX_ROWS, layer_norm as _layer_norm, linear as skinny_linear

logger = logging.getLogger(__name__)


# ---- attention over each row's own length ------------------------------------------------------------------

def decode_attention_reference(qkv, k_cache, v_cache, slots, pos, slopes, scale):
    """The torch version of decode_attention (any device): writes then attends over the whole cache, masked.

    qkv (B, nh*3*hd) in BLOOM's per-head [q, k, v] layout; k_cache/v_cache (S, nh, T, hd) one layer's cache;
    slots, pos (B,) int64; slopes (nh,) fp32. Returns the context (B, nh*hd).
    """
    b = qkv.shape[0]
    nh, t, hd = k_cache.shape[1:]
    q, k, v = qkv.view(b, nh, 3, hd).unbind(2)  # each (B, nh, hd)
    k_cache[slots, :, pos] = k
    v_cache[slots, :, pos] = v
    keys, values = k_cache[slots], v_cache[slots]  # (B, nh, T, hd)
    scores = torch.matmul(q[:, :, None], keys.transpose(-1, -2)).float() * scale  # (B, nh, 1, T)
    distance = (torch.arange(t, device=qkv.device)[None, :] - pos[:, None])[:, None, None, :]  # (B, 1, 1, T) j - i
    scores = scores + slopes[None, :, None, None] * distance.float()
    scores = scores.masked_fill(distance > 0, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(qkv.dtype)
    return torch.matmul(probs, values).reshape(b, nh * hd)  # (B, nh, 1, hd) -> (B, H)


def split_plan(batch, heads, max_len, block_n=64, target_programs=256):
    """The most splits of a row's keys: enough (row, head, split) programs to fill the GPU at a small batch (about
    target_programs), at most one per block of the cache's keys; one once batch x heads reaches target_programs.
    The kernel uses fewer for a short row (triton_decode.py: as many as keep min_keys keys each)."""
    blocks = -(-max_len // block_n)
    return max(1, min(blocks, target_programs // max(1, batch * heads)))


def decode_attention_triton(qkv, k_cache, v_cache, slots, pos, slopes, scale, block_n=64, target_programs=256,
                            warps=4, last_combines=True, min_keys=None, prefetch=False):
    """decode_attention_reference's contract in Triton kernels that read only keys 0..pos[b] of each row
    (block_n keys a loop iteration, at most split_plan's splits of the keys, each of min_keys keys at least
    (default block_n), `warps` warps a program, prefetch: the next block's keys and values loaded while this
    block's are summed; several splits merged by the last one to finish, or with last_combines=False by a second
    kernel). The defaults are the engine's launch."""
    from megatron.inference.skinny_gemm import arrival_counters
    from megatron.inference.triton_decode import combine_kernel, decode_attention_kernel
    b = qkv.shape[0]
    nh, t, hd = k_cache.shape[1:]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and qkv.stride(-1) == 1, \
        (k_cache.stride(), v_cache.stride(), qkv.stride())
    assert hd & (hd - 1) == 0, f"head_dim {hd} must be a power of two for the Triton decode kernel"
    splits = split_plan(b, nh, t, block_n, target_programs)
    min_keys = min_keys or block_n
    out = torch.empty(b, nh * hd, dtype=qkv.dtype, device=qkv.device)
    part = torch.empty(b * nh * splits * hd if splits > 1 else 1, dtype=torch.float32, device=qkv.device)
    stat = torch.empty(b * nh * splits * 2 if splits > 1 else 1, dtype=torch.float32, device=qkv.device)
    last_combines = last_combines and splits > 1
    locks = arrival_counters(qkv.device, b * nh) if last_combines else stat
    decode_attention_kernel[(b, nh, splits)](qkv, k_cache, v_cache, slots, pos, slopes, out, part, stat, locks, scale,
                                             qkv.stride(0), k_cache.stride(0), k_cache.stride(1),
                                             k_cache.stride(2), out.stride(0), HD=hd, BLOCK_N=block_n,
                                             MIN_KEYS=min_keys, NUM_SPLITS=splits,
                                             SPLITS_P2=triton_next_power_of_2(splits), LAST_COMBINES=last_combines,
                                             PREFETCH=bool(prefetch), num_warps=warps)
    if splits > 1 and not last_combines:
        combine_kernel[(b, nh)](part, stat, pos, out, out.stride(0), HD=hd, MIN_KEYS=min_keys, NUM_SPLITS=splits,
                                SPLITS_P2=triton_next_power_of_2(splits))
    return out


def triton_next_power_of_2(n):
    return 1 << (n - 1).bit_length()


# decode_attention_triton's launches FusedDecoder.prepare checks against the torch attention and times for
# gemm="auto" ({}: the defaults). Smaller programs hold fewer registers, so an SM runs more of them (sm_90: 64 keys x
# 4 warps 2 programs, 16 x 1 14). The launches with 32 or 16 keys per iteration were out from 2026-12-04 to
# 2026-12-07: on the H200 they "disagreed with the torch attention" (max error 0.08), but that check compared every
# launch after the first with keys the earlier launches' timed calls had overwritten (a far key counts under the
# small ALiBi slopes of a 16-head model); the check now starts each launch from untouched copies. Not yet rerun on a
# GPU: tests/gpu/test_decode_graph_gemm.py asserts that every launch here passes it.
ATTENTION_LAUNCHES = ({}, dict(block_n=32), dict(block_n=16, warps=4), dict(block_n=16, warps=1),
                      dict(block_n=16, warps=1, target_programs=2048, min_keys=64))


def choose_attention(batch, heads, head_dim, max_len, dtype, device, slopes, scale, timer=None, layers=2,
                     budget=1 << 29, launches=ATTENTION_LAUNCHES):
    """The fastest of `launches` for a batch bucket: each timed (timer(fn) -> seconds, default a CUDA
    graph) over `layers` scratch caches of `batch` rows (not the engine's cache, whose rows may be running; at batch
    64 one is larger than the H200's L2 cache, and at batch 1 the engine's layers fit in it too), every
    row at a quarter and at all of the keys, summed: about a generation's mean context. The scratch holds at most
    `budget` bytes (fewer keys than max_len if need be). A launch that fails or disagrees with the torch attention
    is dropped (logged).
    Returns (launch kwargs, {launch name: seconds per layer})."""
    from megatron.inference.skinny_gemm import graph_time
    keys = max_len
    while keys > 64 and 2 * layers * batch * heads * keys * head_dim * dtype.itemsize > budget:
        keys //= 2
    try:
        k = torch.randn(layers, batch, heads, keys, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
    except torch.OutOfMemoryError:
        logger.warning(f"inference: no memory for the decode attention's timing scratch ({budget >> 20} MiB at "
                       f"most); batch {batch} uses the default launch")
        return {}, {}
    qkv = torch.randn(batch, heads * 3 * head_dim, device=device, dtype=dtype)
    slots = torch.arange(batch, device=device)
    timer = timer or (lambda fn: graph_time(fn, repeats=10))  # a few layers' launches: replayed back to back
    last = torch.full((batch,), keys - 1, device=device, dtype=torch.long)
    # every launch writes the new key/value at its position: each check starts from these untouched copies (the
    # timed calls write at a quarter of the keys, which a later launch's check would otherwise attend over)
    k0, v0 = k[0].clone(), v[0].clone()
    want = decode_attention_reference(qkv, k0.clone(), v0.clone(), slots, last, slopes, scale).float()
    tol = (1e-4 if dtype == torch.float32 else 3e-2) * (1.0 + float(want.abs().max()))
    times = {}
    for launch in launches:
        name = ", ".join(f"{key} {value}" for key, value in launch.items()) or "defaults"
        try:  # a launch must agree with the torch attention before it is timed
            got = decode_attention_triton(qkv, k0.clone(), v0.clone(), slots, last, slopes, scale, **launch).float()
            error = float((got - want).abs().max())
            if not error <= tol:
                raise RuntimeError(f"max error {error:.3g} against the torch attention (tolerance {tol:.3g})")
            total = 0.0
            for context in (max(1, keys // 4), keys):
                pos = torch.full((batch,), context - 1, device=device, dtype=torch.long)

                def fn():
                    for i in range(layers):
                        decode_attention_triton(qkv, k[i], v[i], slots, pos, slopes, scale, **launch)
                total += timer(fn) / layers
            times[name] = (total, launch)
        except Exception as err:  # noqa: BLE001  a launch that fails to compile or capture is not chosen
            logger.warning(f"inference: decode attention {name} failed ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:160] if str(err) else ''}); not a candidate")
    best = min(times, key=lambda key: times[key][0])
    logger.info(f"inference: decode attention batch {batch}, {keys} keys: {best} ("
                + ", ".join(f"{key} {t * 1e6:.1f} us" for key, (t, _) in times.items()) + ")")
    return times[best][1], {key: t for key, (t, _) in times.items()}


_CHECKED = {}


def _triton_check(dtype, head_dim, device):
    """'' if the Triton kernels compile and agree with the torch attention on a small case, else why not."""
    key = (dtype, head_dim, device)
    if key not in _CHECKED:
        gen = torch.Generator().manual_seed(0)
        kc = torch.randn(3, 2, 200, head_dim, generator=gen).to(device, dtype)
        vc = torch.randn(3, 2, 200, head_dim, generator=gen).to(device, dtype)
        qkv = torch.randn(2, 2 * 3 * head_dim, generator=gen).to(device, dtype)
        slots, pos = torch.tensor([2, 0], device=device), torch.tensor([150, 7], device=device)
        slopes = torch.tensor([0.5, 0.25], device=device)
        try:
            want = decode_attention_reference(qkv, kc.clone(), vc.clone(), slots, pos, slopes, head_dim ** -0.5)
            got = decode_attention_triton(qkv, kc.clone(), vc.clone(), slots, pos, slopes, head_dim ** -0.5)
            error = float((got.float() - want.float()).abs().max())
            _CHECKED[key] = "" if error < 0.05 else f"max error {error:.3g} against the torch attention"
        except Exception as err:  # noqa: BLE001  a broken toolchain: reported, the torch attention serves
            _CHECKED[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return _CHECKED[key]


def triton_available(device):
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ---- the segments between attentions (pure torch: torch.compile fuses them) --------------------------------

NO_PLANS = (None,) * 5  # every GEMM by torch


def _linear(x, weight, bias, gemv, plan=None, gelu=False, residual=None):
    """[residual +] [gelu](x W^T + b). plan: megatron/inference/skinny_gemm.py's Triton kernel with that plan (the
    epilogue fused), None: torch. gemv (under inductor's coordinate-descent tuning): at one row, a matmul and an add,
    which inductor lowers to one tuned reduction kernel with the bias fused (its mm decomposition for M = 1; addmm
    has none)."""
    if plan is not None:
        return skinny_linear(x, weight, bias, plan, gelu, residual)
    if gemv and x.shape[0] == 1:
        y = torch.matmul(x, weight.t())
        y = y if bias is None else y + bias
    else:
        y = F.linear(x, weight, bias)
    if gelu:
        y = F.gelu(y, approximate="tanh")
    return y if residual is None else residual + y


def _ln_in_prologue(plan, rows, post_ln):
    """Whether the LayerNorm before a GEMM runs in the Triton kernel's prologue: on a plan, not when the residual
    stream is the LayerNorm's output (post_ln), and for at most GEMV_ROWS rows (each program reads every row of x
    for the statistics: a few KB at a handful of rows, hundreds of KB per program at 64)."""
    return plan is not None and not post_ln and rows <= GEMV_ROWS


def _pre_attention(x, ln_w, ln_b, qkv_w, qkv_b, eps, post_ln, gemv, plans):
    """Block input LayerNorm -> QKV projection: (the residual stream, qkv (B, 3H)); on the Triton kernel the
    LayerNorm is its prologue where _ln_in_prologue."""
    if _ln_in_prologue(plans[0], x.shape[0], post_ln):
        return x, skinny_linear(x, qkv_w, qkv_b, plans[0], ln=(ln_w, ln_b, eps))
    ln = _layer_norm(x, ln_w, ln_b, eps)
    return (ln if post_ln else x), _linear(ln, qkv_w, qkv_b, gemv, plans[0])


def _post_attention(residual, context, dense_w, dense_b, ln_w, ln_b, fc1_w, fc1_b, fc2_w, fc2_b, eps, post_ln,
                    gemv, plans):
    """The rest of a block after attention: dense + residual, LayerNorm, MLP + residual -> (B, H)."""
    x = _linear(context, dense_w, dense_b, gemv, plans[1], residual=residual)
    if _ln_in_prologue(plans[2], x.shape[0], post_ln):  # the LayerNorm in the h->4h kernel's prologue
        h = skinny_linear(x, fc1_w, fc1_b, plans[2], gelu=True, ln=(ln_w, ln_b, eps))
        return _linear(h, fc2_w, fc2_b, gemv, plans[3], residual=x)
    ln = _layer_norm(x, ln_w, ln_b, eps)
    residual = ln if post_ln else x
    return _linear(_linear(ln, fc1_w, fc1_b, gemv, plans[2], gelu=True), fc2_w, fc2_b, gemv, plans[3],
                   residual=residual)


def head_segment(tokens, emb, emb_ln_w, emb_ln_b, ln_w, ln_b, qkv_w, qkv_b, eps, post_ln, gemv, plans=NO_PLANS):
    x = F.embedding(tokens, emb)  # (B, H)
    if emb_ln_w is not None:
        x = _layer_norm(x, emb_ln_w, emb_ln_b, eps)
    return _pre_attention(x, ln_w, ln_b, qkv_w, qkv_b, eps, post_ln, gemv, plans)


def mid_segment(residual, context, dense_w, dense_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b,
                ln_w, ln_b, qkv_w, qkv_b, eps, post_ln, gemv, plans=NO_PLANS):
    x = _post_attention(residual, context, dense_w, dense_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b, eps, post_ln,
                        gemv, plans)
    return _pre_attention(x, ln_w, ln_b, qkv_w, qkv_b, eps, post_ln, gemv, plans)


def tail_segment(residual, context, dense_w, dense_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b,
                 final_w, final_b, emb, eps, post_ln, gemv, vocab_limit, plans=NO_PLANS):
    x = _post_attention(residual, context, dense_w, dense_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b, eps, post_ln,
                        gemv, plans)
    if _ln_in_prologue(plans[4], x.shape[0], False):  # the final LayerNorm in the LM head kernel's prologue
        logits = skinny_linear(x, emb, None, plans[4], ln=(final_w, final_b, eps)).float()  # (B, V)
    else:
        logits = _linear(_layer_norm(x, final_w, final_b, eps), emb, None, gemv, plans[4]).float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        ids = torch.arange(logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(ids >= vocab_limit, float("-inf"))
    return logits


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
GEMMS = ("torch", "triton", "auto")


class FusedDecoder:
    """One decode step of a BloomModel (TP 1) over a StaticKVCache: (tokens, slots, pos) (B,) -> logits (B, V).

    attention: "triton" (CUDA) or "torch" (decode_attention_reference); default: triton where available.
    compile_mode: None (eager) or one of COMPILE_MODES for torch.compile of the segments (static shapes: one
    compilation per batch bucket; CUDA graphs are the engine's, so inductor's own are off). With
    max-autotune-no-cudagraphs inductor also autotunes the GEMMs (cuBLAS or its Triton templates, for M <= 64) and,
    as gpt-fast does, turns on coordinate-descent tuning (process-wide), under which a one-row GEMM becomes a
    tuned reduction kernel.
    gemm: "torch" (default), "triton" (skinny_gemm.py's kernel for every GEMM of a bucket <= 64 rows, its first
    candidate plan) or "auto" (per weight shape and bucket, the kernel's best plan or torch, whichever is faster
    on the device, and per bucket the Triton attention's fastest launch of ATTENTION_LAUNCHES; timed by
    prepare(batch), which the engine calls before it captures a bucket).
    """

    def __init__(self, model, cache, vocab_limit=None, attention=None, compile_mode=None, gemm=None):
        if model.tp_size != 1:
            raise ValueError(f"the fused decode step runs at tensor-parallel size 1 (got {model.tp_size}); "
                             "build the InferenceEngine with decode='unfused'")
        if compile_mode is not None and compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode {compile_mode!r} is not one of {', '.join(COMPILE_MODES)} (or None)")
        config = model.config
        self.eps = config.layernorm_epsilon
        self.post_ln = config.apply_residual_connection_post_layernorm
        self.vocab_limit = vocab_limit
        self.cache = cache
        self.scale = model.layers[0].self_attention.core_attention.scale

        def w(t):
            return None if t is None else t.detach()  # plain tensors: guards on shapes, not on which parameter

        embedding = model.embedding
        self.emb = w(embedding.word_embeddings.weight)
        norm = embedding.word_embeddings_layernorm
        self.emb_ln = (w(norm.weight), w(norm.bias)) if norm is not None else (None, None)
        self.pre, self.post = [], []
        for block in model.layers:
            att, mlp = block.self_attention, block.mlp
            self.pre.append((w(block.input_layernorm.weight), w(block.input_layernorm.bias),
                             w(att.query_key_value.weight), w(att.query_key_value.bias)))
            self.post.append((w(att.dense.weight), w(att.dense.bias), w(block.post_attention_layernorm.weight),
                              w(block.post_attention_layernorm.bias), w(mlp.dense_h_to_4h.weight),
                              w(mlp.dense_h_to_4h.bias), w(mlp.dense_4h_to_h.weight), w(mlp.dense_4h_to_h.bias)))
        self.final = (w(model.final_layernorm.weight), w(model.final_layernorm.bias))

        device = self.emb.device
        head_dim = cache.k.shape[-1]
        if attention is None:  # the kernel's head dimension is one block: a power of two
            attention = "triton" if triton_available(device) and head_dim & (head_dim - 1) == 0 else "torch"
            if attention == "triton":
                failure = _triton_check(cache.k.dtype, head_dim, str(device))
                if failure:
                    logger.warning(f"inference: the Triton decode attention failed its check ({failure}); "
                                   "using the torch attention")
                    attention = "torch"
        if attention == "triton" and not triton_available(device):
            raise ValueError("attention='triton' needs CUDA and the triton package; use attention='torch'")
        self.attention_impl = attention
        gemm = gemm or "torch"
        if gemm not in GEMMS:
            raise ValueError(f"gemm={gemm!r} is not one of {', '.join(GEMMS)}")
        from megatron.inference.skinny_gemm import triton_gemm_available
        if gemm == "triton" and not triton_gemm_available(device):
            raise ValueError("gemm='triton' needs CUDA and the triton package; use gemm='torch' or 'auto'")
        if gemm == "auto" and not triton_gemm_available(device):
            logger.info("inference: gemm='auto' without CUDA and triton: torch's GEMMs")
            gemm = "torch"
        self.gemm = gemm
        self.plans = {}  # batch bucket -> (qkv, dense, h->4h, 4h->h, LM head) plans (None: torch)
        self.gemm_times = {}  # (batch bucket, GEMM) -> {"torch" or a plan's name: seconds per call}, gemm="auto"
        self._attend = decode_attention_triton if attention == "triton" else decode_attention_reference
        self.launches = {}  # batch bucket -> decode_attention_triton's launch (gemm="auto": timed; else defaults)
        self.attention_times = {}  # batch bucket -> {launch: seconds per layer}, gemm="auto"
        self.compile_mode = compile_mode
        self.gemv = False
        self._head, self._mid, self._tail = head_segment, mid_segment, tail_segment
        if compile_mode is not None:
            import torch._dynamo.config as dynamo_config
            # one compilation per batch bucket (1, 2, ..., 64, 128, ...) for each of the three segments
            name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 16))
            self.gemv = compile_mode == "max-autotune-no-cudagraphs"
            if self.gemv:
                import torch._inductor.config as inductor_config
                inductor_config.coordinate_descent_tuning = True
            compile_ = lambda fn: torch.compile(fn, mode=compile_mode, dynamic=False, fullgraph=True)  # noqa: E731
            self._head, self._mid, self._tail = compile_(head_segment), compile_(mid_segment), compile_(tail_segment)
        logger.info(f"inference: fused decode step ({attention} attention, "
                    f"{'eager' if compile_mode is None else 'torch.compile mode ' + compile_mode}, {gemm} GEMMs)")

    def prepare(self, batch):
        """The GEMM plans of a batch bucket (timed on the device for gemm='auto', with the attention's launch);
        outside any graph capture."""
        if batch in self.plans:
            return self.plans[batch]
        if self.gemm == "torch" or batch > MAX_ROWS:
            plans = NO_PLANS
        elif self.gemm == "triton":
            from megatron.inference.skinny_gemm import candidates
            sms = torch.cuda.get_device_properties(self.emb.device).multi_processor_count \
                if self.emb.device.type == "cuda" else 132
            plans = tuple(candidates(batch, w.shape[0], w.shape[1], sms)[0]
                          for w in (self.pre[0][2], self.post[0][0], self.post[0][4], self.post[0][6], self.emb))
        else:
            from megatron.inference.skinny_gemm import choose_plan
            pre, post, chosen = self.pre, self.post, []
            def norms(pairs):  # the LayerNorm a plan runs in its prologue (torch: a LayerNorm, then the GEMM)
                ln = _ln_in_prologue(True, batch, self.post_ln)
                return [(w, b, self.eps) for w, b in pairs] if ln else None
            for label, ws, bs, flags in (("qkv", [p[2] for p in pre], [p[3] for p in pre],
                                          {"norms": norms(p[:2] for p in pre)}),
                                         ("dense", [p[0] for p in post], [p[1] for p in post], {"residual": True}),
                                         ("h->4h", [p[4] for p in post], [p[5] for p in post],
                                          {"gelu": True, "norms": norms(p[2:4] for p in post)}),
                                         ("4h->h", [p[6] for p in post], [p[7] for p in post], {"residual": True}),
                                         ("LM head", [self.emb], [None],  # the final LayerNorm: no residual
                                          {"norms": [(*self.final, self.eps)]
                                           if _ln_in_prologue(True, batch, False) else None})):
                plan, seconds = choose_plan(batch, ws, bs, label=label, **flags)
                chosen.append(plan)
                self.gemm_times[(batch, label)] = seconds
            plans = tuple(chosen)
            if self.attention_impl == "triton":
                k = self.cache.k[0]
                self.launches[batch], self.attention_times[batch] = choose_attention(
                    batch, k.shape[1], k.shape[3], k.shape[2], k.dtype, k.device, self.cache.slopes, self.scale)
        self.plans[batch] = plans
        return plans

    def __call__(self, tokens, slots, pos):
        """Writes each row's new key/value at pos[b] of slot slots[b] and returns fp32 logits (B, V)."""
        cache, eps, post_ln, gemv = self.cache, self.eps, self.post_ln, self.gemv
        plans = self.prepare(tokens.shape[0])
        launch = self.launches.get(tokens.shape[0], {})
        last = len(self.pre) - 1
        residual, qkv = self._head(tokens, self.emb, *self.emb_ln, *self.pre[0], eps, post_ln, gemv, plans)
        for i in range(last + 1):
            context = self._attend(qkv, cache.k[i], cache.v[i], slots, pos, cache.slopes, self.scale, **launch)
            if i < last:
                residual, qkv = self._mid(residual, context, *self.post[i], *self.pre[i + 1], eps, post_ln, gemv,
                                          plans)
        return self._tail(residual, context, *self.post[last], *self.final, self.emb, eps, post_ln, gemv,
                          self.vocab_limit, plans)
