"""The Triton kernels behind spec/kernels.py (imported on first use: Triton is there only with CUDA). What each
computes, and why, is documented with its wrapper in spec/kernels.py."""

import triton
import triton.language as tl

# ---- split-KV attention -----------------------------------------------------------------------------------------


@triton.jit
def attention_partial(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, out_ptr, count_ptr, rows_n, n_tokens, scale,
                      stride_qh, stride_kh, splits,
                      D: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
                      ONE_PASS: tl.constexpr, PDL: tl.constexpr, PRECISION: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    h = tl.program_id(0)
    s = tl.program_id(1)
    pos = tl.load(pos_ptr)
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    keys = s * CHUNK + tl.arange(0, CHUNK)
    row_ok = rows < rows_n
    seen = pos + rows % n_tokens  # the last cache position each row may attend to
    key_ok = keys <= pos + n_tokens - 1
    q = tl.load(q_ptr + h * stride_qh + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    k = tl.load(k_ptr + h * stride_kh + keys[:, None] * D + d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(v_ptr + h * stride_kh + keys[:, None] * D + d[None, :], mask=key_ok[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, CHUNK], fp32
    allowed = (keys[None, :] <= seen[:, None]) & key_ok[None, :]
    scores = tl.where(allowed, scores, float("-inf"))
    m = tl.max(scores, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.where(allowed, tl.exp(scores - m_safe[:, None]), 0.0)
    l = tl.sum(p, 1)
    o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [ROWS, D], fp32
    base = (h * splits + s) * ROWS
    tl.store(m_ptr + base + rows, m, mask=row_ok)  # the padding rows of the tile are not stored
    tl.store(l_ptr + base + rows, l, mask=row_ok)
    tl.store(o_ptr + (base + rows[:, None]) * D + d[None, :], o, mask=row_ok[:, None])
    if ONE_PASS > 0:
        # The head's last program to finish combines its chunks: the barrier orders every warp's stores before
        # the counter's release, whose acquire by the last program makes them visible to it; it sets the counter
        # back to 0 for the next launch.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + h, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            tl.atomic_xchg(count_ptr + h, 0, sem="relaxed", scope="gpu")
            combine_rows(o_ptr, m_ptr, l_ptr, out_ptr, h, 0, rows_n, splits, D, ROWS, SPLITS, ONE_PASS)


@triton.jit
def combine_rows(o_ptr, m_ptr, l_ptr, out_ptr, h, r0, rows_n, splits,
                 D: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, RB: tl.constexpr):
    """Rows r0..r0+RB-1 of head h: rescale the chunks' sums to a common maximum and normalise. Loads bypass L1
    (.cg): in the one-pass kernel other programs wrote them."""
    r = r0 + tl.arange(0, RB)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    ok = (r < rows_n)[:, None] & (s < splits)[None, :]  # [RB, SPLITS]
    index = (h * splits + s[None, :]) * ROWS + r[:, None]
    m = tl.load(m_ptr + index, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + index, mask=ok, other=0.0, cache_modifier=".cg")
    o = tl.load(o_ptr + index[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0,
                cache_modifier=".cg")  # [RB, SPLITS, D]
    top = tl.max(m, 1)  # finite for a real row: position 0 is visible to every row
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(ok & (m != float("-inf")), tl.exp(m - top[:, None]), 0.0)
    den = tl.sum(w * l, 1)
    out = tl.sum(w[:, :, None] * o, 1) / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(out_ptr + (h * rows_n + r[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(r < rows_n)[:, None])


@triton.jit
def attention_combine(o_ptr, m_ptr, l_ptr, out_ptr, rows_n, splits,
                      D: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    combine_rows(o_ptr, m_ptr, l_ptr, out_ptr, tl.program_id(0), tl.program_id(1), rows_n, splits, D, ROWS, SPLITS, 1)


# ---- the fused one-token step -----------------------------------------------------------------------------------
#
# With PDL (programmatic dependent launch, Hopper and later) a kernel lets the next one start at once; the next one
# loads its first weight tile -- weights no kernel writes -- and only then waits for this one to finish. The wait
# is the first thing before any read of another kernel's output and before any write.


@triton.jit
def weight_tile(w_ptr, rows, rm, ks, K):
    return tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=rm[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def first_tiles(w_ptr, rows, rm, ks, K, N, EPILOGUE: tl.constexpr):
    """A product's first weight tile, and for SILU_MUL the up projection's (rows N.. of the weight): loaded before
    the wait for the previous kernel."""
    w = weight_tile(w_ptr, rows, rm, ks, K)
    u = w
    if EPILOGUE == 1:
        u = weight_tile(w_ptr, rows + N, rm, ks, K)
    return w, u


@triton.jit
def store_epilogue(out, ok, y, up, like_ptr, EPILOGUE: tl.constexpr):
    """ADD (0): out += y; SILU_MUL (1): out = SiLU(y) * up; LOGITS (2): out = y, fp32. Each rounded to the model's
    dtype (like_ptr's) where the transformers model rounds; RAW (3): out = y, fp32, unrounded (for rope_rows)."""
    dtype = like_ptr.dtype.element_ty
    if EPILOGUE != 3:
        y = y.to(dtype).to(tl.float32)
    if EPILOGUE == 0:  # the residual stream, in place
        h = tl.load(out, mask=ok, other=0.0).to(tl.float32)
        tl.store(out, (h + y).to(dtype), mask=ok)
    elif EPILOGUE == 1:
        up = up.to(dtype).to(tl.float32)
        silu = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)
        tl.store(out, (silu * up).to(dtype), mask=ok)
    else:
        tl.store(out, y, mask=ok)


@triton.jit
def rotary(ya, yb, ca, cb, sa, sb, rotate, like_ptr):
    """A head's two halves, rounded to like_ptr's dtype: for q and k (`rotate`) x * cos + rotate_half(x) * sin, each
    term rounded as transformers rounds it; for v as they are."""
    dtype = like_ptr.dtype.element_ty
    out_a = ya.to(dtype)
    out_b = yb.to(dtype)
    if rotate:
        out_a = ((ya * ca).to(dtype).to(tl.float32) + (-yb * sa).to(dtype).to(tl.float32)).to(dtype)
        out_b = ((yb * cb).to(dtype).to(tl.float32) + (ya * sb).to(dtype).to(tl.float32)).to(dtype)
    return out_a, out_b


@triton.jit
def qkv_rope(h_ptr, nw_ptr, eps, w_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, K, kv_stride,
             HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
             BH: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    head = tl.program_id(0)  # q heads, then k heads, then v heads
    j = tl.program_id(1) * BH + tl.arange(0, BH)  # a block of the first half of the head's dimensions
    rows_a = head * D + j
    rows_b = rows_a + D // 2  # their rotary partners
    every = j >= 0
    ks = tl.arange(0, BLOCK_K)
    wa = weight_tile(w_ptr, rows_a, every, ks, K)
    wb = weight_tile(w_ptr, rows_b, every, ks, K)
    # The position, rotary tables and biases are written before the step starts: load them early too.
    pos = tl.load(pos_ptr)
    ca = tl.load(cos_ptr + pos * D + j).to(tl.float32)
    cb = tl.load(cos_ptr + pos * D + D // 2 + j).to(tl.float32)
    sa = tl.load(sin_ptr + pos * D + j).to(tl.float32)
    sb = tl.load(sin_ptr + pos * D + D // 2 + j).to(tl.float32)
    ba = tl.zeros([BH], tl.float32)
    bb = tl.zeros([BH], tl.float32)
    if HAS_BIAS:
        ba = tl.load(b_ptr + rows_a).to(tl.float32)
        bb = tl.load(b_ptr + rows_b).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc_a = tl.zeros([BH, BLOCK_K], tl.float32)
    acc_b = tl.zeros([BH, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        wa_next = weight_tile(w_ptr, rows_a, every, k0 + BLOCK_K + ks, K)
        wb_next = weight_tile(w_ptr, rows_b, every, k0 + BLOCK_K + ks, K)
        km = k0 + ks < K
        x = tl.load(h_ptr + k0 + ks, mask=km, other=0.0).to(tl.float32)
        sq += x * x
        x = x * tl.load(nw_ptr + k0 + ks, mask=km, other=0.0).to(tl.float32)
        acc_a += wa.to(tl.float32) * x[None, :]
        acc_b += wb.to(tl.float32) * x[None, :]
        wa = wa_next
        wb = wb_next
    r = tl.rsqrt(tl.sum(sq, 0) / K + eps)  # RMSNorm's scale, applied after the sum
    ya = tl.sum(acc_a, 1) * r
    yb = tl.sum(acc_b, 1) * r
    dtype = q_ptr.dtype.element_ty
    ya = (ya + ba).to(dtype).to(tl.float32)
    yb = (yb + bb).to(dtype).to(tl.float32)
    out_a, out_b = rotary(ya, yb, ca, cb, sa, sb, head < HEADS + KV, q_ptr)
    if head < HEADS:
        tl.store(q_ptr + rows_a, out_a)
        tl.store(q_ptr + rows_b, out_b)
    elif head < HEADS + KV:
        base = kc_ptr + (head - HEADS) * kv_stride + pos * D
        tl.store(base + j, out_a)
        tl.store(base + D // 2 + j, out_b)
    else:
        base = vc_ptr + (head - HEADS - KV) * kv_stride + pos * D
        tl.store(base + j, out_a)
        tl.store(base + D // 2 + j, out_b)


@triton.jit
def gemv(x_ptr, nw_ptr, eps, w_ptr, out_ptr, N, K,
         NORM: tl.constexpr, EPILOGUE: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = rows < N
    ks = tl.arange(0, BLOCK_K)
    w, u = first_tiles(w_ptr, rows, rm, ks, K, N, EPILOGUE)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BN, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BN, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_next = weight_tile(w_ptr, rows, rm, k0 + BLOCK_K + ks, K)
        u_next = w_next
        if EPILOGUE == 1:
            u_next = weight_tile(w_ptr, rows + N, rm, k0 + BLOCK_K + ks, K)
        km = k0 + ks < K
        x = tl.load(x_ptr + k0 + ks, mask=km, other=0.0).to(tl.float32)
        if NORM:
            sq += x * x
            x = x * tl.load(nw_ptr + k0 + ks, mask=km, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if EPILOGUE == 1:
            acc_up += u.to(tl.float32) * x[None, :]
        w = w_next
        u = u_next
    y = tl.sum(acc, 1)
    up = tl.sum(acc_up, 1)
    if NORM:  # RMSNorm's scale, applied after the sum
        r = tl.rsqrt(tl.sum(sq, 0) / K + eps)
        y = y * r
        up = up * r
    store_epilogue(out_ptr + rows, rm, y, up, x_ptr, EPILOGUE)


# ---- the fused forward of 2-16 tokens (a verify pass, a draft's catch-up) -----------------------------------------
#
# The same products for M <= MP tokens at once. Each program owns BN output rows, as above, and reads every weight
# once for all M tokens: the weight tile [BN, BLOCK_K] is the left operand of a tensor-core product with the tokens'
# inputs [BLOCK_K, MP] (M padded to MP = 16 columns, the smallest tile a tensor core takes), so the weight stays in
# its own row-major layout and the loop is the plain one Triton software-pipelines (`num_stages`). The first
# iteration is peeled: its weight tile is loaded before the wait for the previous kernel (PDL).


@triton.jit
def tokens_tile(x_ptr, ks, ms, mm, K, M, XD: tl.constexpr):
    """Inputs of M tokens, transposed: [BLOCK_K, MP]. x is [M, K] (XD = 0) or head-major [K // XD, M, XD] (the
    attention's output, XD = head size)."""
    if XD == 0:
        off = ms[None, :] * K + ks[:, None]
    else:
        off = (ks[:, None] // XD) * (M * XD) + ms[None, :] * XD + ks[:, None] % XD
    return tl.load(x_ptr + off, mask=mm[None, :] & (ks < K)[:, None], other=0.0)


@triton.jit
def normed_tile(x_ptr, nw_ptr, ks, ms, mm, K, M, sq, XD: tl.constexpr, NORM: tl.constexpr):
    """The tokens' inputs (times RMSNorm's weight, in the model's dtype) and the running sum of their squares."""
    x = tokens_tile(x_ptr, ks, ms, mm, K, M, XD)
    if NORM:
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, 0)
        g = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        x = (xf * g[:, None]).to(x_ptr.dtype.element_ty)
    return x, sq


@triton.jit
def gemv_rows(x_ptr, nw_ptr, eps, w_ptr, out_ptr, M, N, K,
              NORM: tl.constexpr, EPILOGUE: tl.constexpr, XD: tl.constexpr, BN: tl.constexpr,
              BLOCK_K: tl.constexpr, MP: tl.constexpr, PDL: tl.constexpr, PRECISION: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = rows < N
    ms = tl.arange(0, MP)
    mm = ms < M
    ks = tl.arange(0, BLOCK_K)
    w, u = first_tiles(w_ptr, rows, rm, ks, K, N, EPILOGUE)
    if PDL:
        tl.extra.cuda.gdc_wait()
    sq = tl.zeros([MP], tl.float32)
    x, sq = normed_tile(x_ptr, nw_ptr, ks, ms, mm, K, M, sq, XD, NORM)
    acc = tl.dot(w, x, input_precision=PRECISION)  # [BN, MP], fp32
    acc_up = acc
    if EPILOGUE == 1:
        acc_up = tl.dot(u, x, input_precision=PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x, sq = normed_tile(x_ptr, nw_ptr, k0 + ks, ms, mm, K, M, sq, XD, NORM)
        acc = tl.dot(weight_tile(w_ptr, rows, rm, k0 + ks, K), x, acc, input_precision=PRECISION)
        if EPILOGUE == 1:
            acc_up = tl.dot(weight_tile(w_ptr, rows + N, rm, k0 + ks, K), x, acc_up, input_precision=PRECISION)
    y = acc
    up = acc_up
    if NORM:  # RMSNorm's scale, per token, applied after the sum
        r = tl.rsqrt(sq / K + eps)
        y = y * r[None, :]
        up = up * r[None, :]
    # out is [M, N]
    store_epilogue(out_ptr + ms[None, :] * N + rows[:, None], rm[:, None] & mm[None, :], y, up, x_ptr, EPILOGUE)


@triton.jit
def rope_rows(y_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, M, kv_stride,
              HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, MP: tl.constexpr,
              PDL: tl.constexpr):
    """The q/k/v product's epilogue for M tokens, one program a head: y [M, (HEADS + 2 KV) * D] (fp32, RMSNorm's
    scale applied) + bias, rounded; rotary embedding on q and k; q out head-major [HEADS, M, D], k and v into the
    caches at pos + m. The same arithmetic as qkv_rope's epilogue."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    head = tl.program_id(0)  # q heads, then k heads, then v heads
    j = tl.arange(0, D // 2)
    ms = tl.arange(0, MP)
    mm = ms < M
    pos = tl.load(pos_ptr) + ms  # each token's position [MP]
    table = pos[None, :] * D + j[:, None]  # [D / 2, MP]
    ok = (j >= 0)[:, None] & mm[None, :]
    ca = tl.load(cos_ptr + table, mask=ok, other=0.0).to(tl.float32)
    cb = tl.load(cos_ptr + table + D // 2, mask=ok, other=0.0).to(tl.float32)
    sa = tl.load(sin_ptr + table, mask=ok, other=0.0).to(tl.float32)
    sb = tl.load(sin_ptr + table + D // 2, mask=ok, other=0.0).to(tl.float32)
    ba = tl.zeros([D // 2], tl.float32)
    bb = tl.zeros([D // 2], tl.float32)
    if HAS_BIAS:
        ba = tl.load(b_ptr + head * D + j).to(tl.float32)
        bb = tl.load(b_ptr + head * D + D // 2 + j).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    n = (HEADS + 2 * KV) * D
    y = y_ptr + ms[None, :] * n + head * D + j[:, None]
    dtype = q_ptr.dtype.element_ty
    ya = (tl.load(y, mask=ok, other=0.0) + ba[:, None]).to(dtype).to(tl.float32)
    yb = (tl.load(y + D // 2, mask=ok, other=0.0) + bb[:, None]).to(dtype).to(tl.float32)
    out_a, out_b = rotary(ya, yb, ca, cb, sa, sb, head < HEADS + KV, q_ptr)
    if head < HEADS:  # q is head-major [HEADS, M, D], the layout the attention reads
        base = q_ptr + (head * M + ms[None, :]) * D + j[:, None]
    elif head < HEADS + KV:
        base = kc_ptr + (head - HEADS) * kv_stride + table
    else:
        base = vc_ptr + (head - HEADS - KV) * kv_stride + table
    tl.store(base, out_a, mask=ok)
    tl.store(base + D // 2, out_b, mask=ok)
