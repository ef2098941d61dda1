"""The Triton kernels behind spec/kernels.py (imported on first use: Triton is there only with CUDA). What each
computes, and why, is documented with its wrapper in spec/kernels.py."""

import triton
import triton.language as tl

# ---- split-KV attention -----------------------------------------------------------------------------------------


@triton.jit
def attention_partial(q_ptr, k_ptr, v_ptr, pos_ptr, tree_ptr, o_ptr, m_ptr, l_ptr, out_ptr, count_ptr, rows_n, n_tokens,
                      scale, stride_qh, stride_kh, splits,
                      D: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
                      ONE_PASS: tl.constexpr, PDL: tl.constexpr, PRECISION: tl.constexpr, TREE: tl.constexpr,
                      RSTRIDE: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.program_id(0)
    s = tl.program_id(1)
    pos = tl.load(pos_ptr)
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)  # this program's block of the head's rows
    d = tl.arange(0, D)
    keys = s * CHUNK + tl.arange(0, CHUNK)
    row_ok = rows < rows_n
    k, v = chunk_kv(k_ptr, v_ptr, h, stride_kh, keys, pos, pos + n_tokens, D, PDL)
    q = tl.load(q_ptr + h * stride_qh + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, CHUNK], fp32
    allowed = visible(keys, rows, row_ok, pos, n_tokens, tree_ptr, TREE)
    scores = tl.where(allowed, scores, float("-inf"))
    m = tl.max(scores, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.where(allowed, tl.exp(scores - m_safe[:, None]), 0.0)
    l = tl.sum(p, 1)
    o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [ROWS, D], fp32
    base = (h * splits + s) * RSTRIDE  # RSTRIDE: the row blocks' rows together
    tl.store(m_ptr + base + rows, m, mask=row_ok)  # the padding rows of the tile are not stored
    tl.store(l_ptr + base + rows, l, mask=row_ok)
    # A row that saw no key of this chunk (a chunk past the text: the span's rounding up) has o = 0 and m = -inf,
    # and the combine gives it weight 0: its o is neither stored nor read.
    tl.store(o_ptr + (base + rows[:, None]) * D + d[None, :], o, mask=(row_ok & (m != float("-inf")))[:, None])
    if ONE_PASS > 0:
        if last_to_finish(count_ptr + h, splits):  # the head's last program combines its chunks
            combine_rows(o_ptr, m_ptr, l_ptr, out_ptr, h, 0, rows_n, splits, D, RSTRIDE, SPLITS, ONE_PASS)


@triton.jit
def attention_parts(q_ptr, k_ptr, v_ptr, pos_ptr, tree_ptr, o_ptr, m_ptr, l_ptr, out_ptr, count_ptr, rows_n, n_tokens,
                    scale, stride_qh, stride_kh, parts, span,
                    D: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, RB: tl.constexpr,
                    PDL: tl.constexpr, PRECISION: tl.constexpr, TREE: tl.constexpr, RSTRIDE: tl.constexpr):
    """A block of ROWS of a head's query rows over one of `parts` runs of consecutive chunks of the text (the text's
    chunks dealt out evenly, from the position this forward starts at), with a running softmax over the run's
    chunks; the last of the block's `parts` programs to finish combines them, RB rows at a time. One part: the
    program normalises and stores its rows itself."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2)
    pos = tl.load(pos_ptr)
    rows = b * ROWS + tl.arange(0, ROWS)
    row_ok = rows < rows_n
    d = tl.arange(0, D)
    limit = tl.minimum(pos + n_tokens, span)  # the slots it reads: the text, this forward's tokens, within the span
    chunks = tl.cdiv(limit, CHUNK)
    each = tl.cdiv(chunks, parts)
    first = s * each
    end = tl.minimum(first + each, chunks)  # first >= end: a part past the text (it sees no key)
    keys = first * CHUNK + tl.arange(0, CHUNK)
    k, v = chunk_kv(k_ptr, v_ptr, h, stride_kh, keys, pos, limit, D, PDL)  # (the later chunks: after the wait)
    q = tl.load(q_ptr + h * stride_qh + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    o = tl.zeros([ROWS, D], tl.float32)
    m, l, o = running_softmax(q, k, v, keys, limit, rows, row_ok, pos, n_tokens, tree_ptr, scale, m, l, o, PRECISION,
                              TREE)
    for c in range(first + 1, end):
        keys = c * CHUNK + tl.arange(0, CHUNK)
        at = h * stride_kh + keys[:, None] * D + d[None, :]
        ok = (keys < limit)[:, None]
        k = tl.load(k_ptr + at, mask=ok, other=0.0)
        v = tl.load(v_ptr + at, mask=ok, other=0.0)
        m, l, o = running_softmax(q, k, v, keys, limit, rows, row_ok, pos, n_tokens, tree_ptr, scale, m, l, o,
                                  PRECISION, TREE)
    if SPLITS == 1:  # every chunk of the text: position 0 is visible to every real row, so l > 0
        out = o / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + (h * rows_n + rows[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        at = (h * parts + s) * RSTRIDE
        tl.store(m_ptr + at + rows, m, mask=row_ok)
        tl.store(l_ptr + at + rows, l, mask=row_ok)
        tl.store(o_ptr + (at + rows[:, None]) * D + d[None, :], o, mask=(row_ok & (m != float("-inf")))[:, None])
        if last_to_finish(count_ptr + h * tl.num_programs(2) + b, parts):
            for i in tl.static_range(ROWS // RB):
                combine_rows(o_ptr, m_ptr, l_ptr, out_ptr, h, b * ROWS + i * RB, rows_n, parts, D, RSTRIDE, SPLITS,
                             RB)


@triton.jit
def chunk_kv(k_ptr, v_ptr, h, stride_kh, keys, pos, limit, D: tl.constexpr, PDL: tl.constexpr):
    """Head h's cached keys and values at `keys` [CHUNK, D], zeros at or past `limit`; with PDL, the kernel waits
    here for the one launched before it. The slots before pos hold earlier forwards' keys and values: every forward
    begins with kernels launched without PDL (the embedding's row, the position's fill), which start once all work
    before them has finished, so those slots are written before this kernel starts, and they are loaded before the
    wait, while the q/k/v kernel still runs. This forward's own slots, pos.., which that kernel writes, are loaded
    after it."""
    d = tl.arange(0, D)
    at = h * stride_kh + keys[:, None] * D + d[None, :]
    earlier = (keys < pos)[:, None]
    k = tl.load(k_ptr + at, mask=earlier, other=0.0)
    v = tl.load(v_ptr + at, mask=earlier, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    new = ((keys >= pos) & (keys < limit))[:, None]
    k = tl.where(new, tl.load(k_ptr + at, mask=new, other=0.0), k)
    v = tl.where(new, tl.load(v_ptr + at, mask=new, other=0.0), v)
    return k, v


@triton.jit
def running_softmax(q, k, v, keys, limit, rows, row_ok, pos, n_tokens, tree_ptr, scale, m, l, o,
                    PRECISION: tl.constexpr, TREE: tl.constexpr):
    """One chunk's keys and values into a running softmax: the maximum m, the sum l and the unnormalised output o,
    rescaled to the new maximum (a row that has seen no key yet keeps m = -inf, l = 0, o = 0)."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    allowed = visible(keys, rows, row_ok, pos, n_tokens, tree_ptr, TREE) & (keys < limit)[None, :]
    scores = tl.where(allowed, scores, float("-inf"))
    top = tl.maximum(m, tl.max(scores, 1))
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    p = tl.where(allowed, tl.exp(scores - top_safe[:, None]), 0.0)
    old = tl.exp(m - top_safe)  # 0 where m = -inf
    l = l * old + tl.sum(p, 1)
    o = o * old[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return top, l, o


@triton.jit
def visible(keys, rows, row_ok, pos, n_tokens, tree_ptr, TREE: tl.constexpr):
    """[ROWS, CHUNK]: which of the cached `keys` each of the query `rows` attends to (row r is token r % n_tokens, in
    slot pos + r % n_tokens). Causal: the slots up to the row's own. A token tree: tree_ptr = [base, bits of token 0,
    ..]; a row sees every slot before `base` and, of the 64 from `base` on, those whose bit is set in its token's mask
    (its ancestors and itself). Never a slot past the forward's last token."""
    key_ok = keys <= pos + n_tokens - 1
    if TREE:
        base = tl.load(tree_ptr)
        bits = tl.load(tree_ptr + 1 + rows % n_tokens, mask=row_ok, other=0)  # [ROWS] int64
        rel = keys - base  # [CHUNK]
        window = (rel >= 0) & (rel < 64)
        shift = tl.where(window, rel, 0).to(tl.int64)
        marked = ((bits[:, None] >> shift[None, :]) & 1) != 0
        return ((rel < 0)[None, :] | (window[None, :] & marked)) & key_ok[None, :]
    return (keys[None, :] <= (pos + rows % n_tokens)[:, None]) & key_ok[None, :]


@triton.jit
def last_to_finish(counter, programs):
    """Whether this program is the last of `programs` sharing `counter` to get here, once it has stored its part:
    the barrier orders every warp's stores before the counter's release, whose acquire by the last program makes
    them visible to it (it then reads them with .cg loads, past L1); the last sets the counter back to 0 for the
    next launch."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == programs - 1
    if last:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return last


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
    seen = ok & (m != float("-inf"))  # chunks where the row saw a key: the others stored no o
    o = tl.load(o_ptr + index[:, :, None] * D + d[None, None, :], mask=seen[:, :, None], other=0.0,
                cache_modifier=".cg")  # [RB, SPLITS, D]
    top = tl.max(m, 1)  # finite for a real row: position 0 is visible to every row
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(seen, tl.exp(m - top[:, None]), 0.0)
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
# is the first thing before any read of another kernel's output and before any write (but the attention's reads of
# cache slots earlier forwards wrote: `attention_partial`, kernels.decode_attention).


#
# Weights come in three formats (QUANT, spec/models/quant.py's PackedWeight): 0, the model's dtype, [N, K]; 1, int8
# codes [N, K] with one scale per row (s_ptr [N]), applied to the row's sum (`row_scales`); 2, int4, two codes a
# byte [N, K / 2], group by group (a group's first G / 2 inputs in the low nibbles of its G / 2 bytes, the rest in the
# high ones), with a scale and an offset per group (s_ptr, z_ptr [N, K / G]): w = (q - 8) s + z. A one-token
# product reads int4 tiles as int32 words and sums each group before scaling it (`int4_word_sums`:
# s sum((q - 8) x) + z sum(x)), so no scale is repeated per input; the 2-64-token one de-quantises a tile of whole
# groups (each byte with its group's scale) into two tensor-core operands, the groups' first and second halves
# (`int4_tile_dot`; a group at a time, 16-input products, took 10.6-12.0 ms for the 1B's 2-16-token forward on an
# H100 against 0.83 ms for its one-token step). A tile is loaded as it is stored (`weight_tile`) and de-quantised
# only where it is used, so loading the next tile still overlaps the arithmetic on this one.


@triton.jit
def weight_tile(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr):
    """Rows `rows` x inputs k0..k0+BLOCK_K-1 of a weight, as stored: (the tile, its scales, its offsets). int4:
    bytes [rows, BLOCK_K / G, G / 2] and per-group scales and offsets [rows, BLOCK_K / G]; else [rows, BLOCK_K]
    and zeros for the scales and offsets."""
    s = 0.0
    z = 0.0
    if QUANT == 2:
        g = k0 // G + tl.arange(0, BLOCK_K // G)
        j = tl.arange(0, G // 2)
        gm = g < K // G
        w = tl.load(w_ptr + rows[:, None, None] * (K // 2) + g[None, :, None] * (G // 2) + j[None, None, :],
                    mask=rm[:, None, None] & gm[None, :, None], other=0)
        at = rows[:, None] * (K // G) + g[None, :]
        s = tl.load(s_ptr + at, mask=rm[:, None] & gm[None, :], other=0.0)
        z = tl.load(z_ptr + at, mask=rm[:, None] & gm[None, :], other=0.0)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        # other=0.0: a float, which every code dtype takes (fp8 codes do not take the integer 0 in Triton's interpreter)
        w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=rm[:, None] & (ks < K)[None, :], other=0.0)
    return w, s, z


@triton.jit
def exact_float(code, bias: tl.constexpr):
    """code - bias as fp32, for integer codes (int8, or uint8 below 256 - bias): the same value as
    code.to(tl.float32) - bias without the conversion instruction. Integer-to-float conversions run at a quarter of
    the rate of the other arithmetic on an H100/H200 (16 a clock per multiprocessor against 64), and a packed
    one-token product does one a weight. Instead the code goes into the low bits of 2^23's mantissa (an integer
    add or or, widening a byte at the full rate), and the float 2^23 + c less 2^23 + bias is exact for
    0 <= c < 2^23: the sum is an integer below 2^24. Measured on an H100 (session 17): the 1B's packed one-token
    step 4-5 % faster at most (int8 0.745 -> 0.709-0.717 ms), within the spread between runs: the conversion was one
    of the 8-9 instructions an int4 weight cost in the byte kernel's loop (benchmarks/kernel_mix.py); the one-token
    int4 products now read words instead (`int4_word_sums`), this is for int8 and the multi-token int4 tiles."""
    if code.dtype == tl.int8:  # q in [-128, 127]: 2^23 + 128 + q, then subtract 2^23 + 128 + bias
        word = code.to(tl.int32) + 0x4B000080
        return word.to(tl.float32, bitcast=True) - (8388736.0 + bias)
    else:
        word = code.to(tl.int32) | 0x4B000000
        return word.to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def as_float(w):
    """A stored tile as fp32: int8 codes by `exact_float`, the model's dtype and fp8 by conversion."""
    if w.dtype == tl.int8:
        return exact_float(w, 0)
    else:
        return w.to(tl.float32)


# The one-token int4 product reads its codes as int32 words, eight codes a word: byte j of word i of a group (the
# group's bytes 4i..4i+3) holds the code of input 4i + j in its low nibble and of input G / 2 + 4i + j in its high
# one. Each code becomes a float in one instruction, where it lies (`nibble_float`): each byte shifted to bits 15-22
# (one shift), its two nibbles at bits 15-18 and 19-22, masked into the mantissa of 2^8 (0x43800000, whose mantissa
# is bits 0-22; bit 15 is worth 1) are the floats 256 + q and 256 + 16 q, exactly. The low nibbles' inputs are taken
# as they are and the high ones' divided by 16, so a group's sum over its words is sum(q x) + 256 sum(x_low) +
# 16 sum(x_high), and the inputs' own sums take the constants back out once a tile for every row (`int4_inputs`,
# `int4_word_sums`); the cancellation costs fp32 about 5 of its 24 bits (256 against codes of 7.5 on average), a
# draft's products nothing it can notice (any draft keeps the answer exact; acceptance may move). 4.0-4.9 machine
# instructions a weight where each byte in its own register took 8-9 (benchmarks/kernel_mix.py, in tiles where a
# thread holds several rows, which share the inputs it loads); the 1B's int4 step on an H100 0.684 ms against
# 0.779 (docs/quantization.md).
_ASM = tl.constexpr(not triton.knobs.runtime.interpret)  # the interpreter runs no PTX (Triton's own reading of it)


@triton.jit
def nibble_float(word, HIGH: tl.constexpr):
    """Bits 15-18 (HIGH 0) or 19-22 (HIGH 1) of each int32 word as fp32 256 + q or 256 + 16 q: (word & mask) |
    0x43800000, one LOP3 instruction on a GPU (left to itself ptxas spends two, one for each constant)."""
    if _ASM:
        if HIGH:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00780000, 0x43800000, 0xEA;", "=r,r", [word],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00078000, 0x43800000, 0xEA;", "=r,r", [word],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (word & (0x00780000 if HIGH else 0x00078000)) | 0x43800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def int4_words(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """Rows `rows` x inputs k0..k0+BLOCK_K-1 of an int4 weight for one token: int32 words [rows, BLOCK_K / 8]
    (the codes' bytes read four at a time), and the groups' scales and offsets [rows, BLOCK_K / G]."""
    kw = tl.multiple_of(K // 8, 4)  # K is whole groups of 32: every row's words start 16-byte aligned
    wi = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    w = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * kw + wi[None, :],
                mask=rm[:, None] & (wi < kw)[None, :], other=0)
    g = k0 // G + tl.arange(0, BLOCK_K // G)
    at = rows[:, None] * (K // G) + g[None, :]
    gm = rm[:, None] & (g < K // G)[None, :]
    return w, tl.load(s_ptr + at, mask=gm, other=0.0), tl.load(z_ptr + at, mask=gm, other=0.0)


@triton.jit
def token_at(at, m, M, K, XD: tl.constexpr):
    """Where token m of M has its inputs `at`: x is [M, K] (XD = 0) or head-major [K // XD, M, XD] (the attention's
    output, XD = head size)."""
    if XD == 0:
        return m * K + at
    else:
        return (at // XD) * (M * XD) + m * XD + at % XD


@triton.jit
def int4_input(x_ptr, nw_ptr, k0, K, J: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """The input of code J (0-3: byte J's low nibble, 4-7: byte J - 4's high nibble) of each word of a tile, [BLOCK_K
    / 8] fp32: as read (for the norm's sum of squares) and times RMSNorm's weight with NORM."""
    wi = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    at = (wi // (G // 8)) * G + (wi % (G // 8)) * 4 + J % 4 + (J // 4) * (G // 2)
    ok = wi < K // 8
    x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    xn = x
    if NORM:
        xn = x * tl.load(nw_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return x, xn


@triton.jit
def word_inputs(x_ptr, nw_ptr, k0, K, sq, NORM: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """One token's inputs of the eight codes of each word of a tile (`int4_input`: bytes 0-3's low nibbles, then
    their high ones; [BLOCK_K / 8] each, times RMSNorm's weight with NORM), and the running sum of squares."""
    r0, l0 = int4_input(x_ptr, nw_ptr, k0, K, 0, NORM, BLOCK_K, G)
    r1, l1 = int4_input(x_ptr, nw_ptr, k0, K, 1, NORM, BLOCK_K, G)
    r2, l2 = int4_input(x_ptr, nw_ptr, k0, K, 2, NORM, BLOCK_K, G)
    r3, l3 = int4_input(x_ptr, nw_ptr, k0, K, 3, NORM, BLOCK_K, G)
    r4, h0 = int4_input(x_ptr, nw_ptr, k0, K, 4, NORM, BLOCK_K, G)
    r5, h1 = int4_input(x_ptr, nw_ptr, k0, K, 5, NORM, BLOCK_K, G)
    r6, h2 = int4_input(x_ptr, nw_ptr, k0, K, 6, NORM, BLOCK_K, G)
    r7, h3 = int4_input(x_ptr, nw_ptr, k0, K, 7, NORM, BLOCK_K, G)
    if NORM:
        sq += r0 * r0 + r1 * r1 + r2 * r2 + r3 * r3 + r4 * r4 + r5 * r5 + r6 * r6 + r7 * r7
    return l0, l1, l2, l3, h0, h1, h2, h3, sq


@triton.jit
def int4_inputs(x_ptr, nw_ptr, k0, K, sq, NORM: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """One token's inputs for a tile of int4 words: each code's input (`int4_input`; the high nibbles' divided by
    16), per group of the tile sum(x) and 264 sum(x_low) + 24 sum(x_high) (what the floats' 256 and 16, and the
    codes' offset 8, add to a group's sum), and the running sum of squares ([BLOCK_K / 8])."""
    l0, l1, l2, l3, h0, h1, h2, h3, sq = word_inputs(x_ptr, nw_ptr, k0, K, sq, NORM, BLOCK_K, G)
    low = l0 + l1 + l2 + l3
    high = h0 + h1 + h2 + h3
    groups: tl.constexpr = BLOCK_K // G
    total = tl.sum(tl.reshape(low + high, (groups, G // 8)), 1)
    offset = tl.sum(tl.reshape(264.0 * low + 24.0 * high, (groups, G // 8)), 1)
    return l0, l1, l2, l3, h0 * 0.0625, h1 * 0.0625, h2 * 0.0625, h3 * 0.0625, total, offset, sq


@triton.jit
def int4_word_sums(w, s, z, l0, l1, l2, l3, h0, h1, h2, h3, total, offset, G: tl.constexpr):
    """Each group's share of a one-token product, [rows, groups]: s sum((q - 8) x) + z sum(x), from the words'
    sums of (256 + q) x_low and (256 + 16 q) x_high / 16 (one multiply-add a code) less the group's offset."""
    t = w << 15  # byte 0 to bits 15-22
    a = nibble_float(t, 0) * l0[None, :]
    a = nibble_float(t, 1) * h0[None, :] + a
    t = w << 7  # byte 1
    a = nibble_float(t, 0) * l1[None, :] + a
    a = nibble_float(t, 1) * h1[None, :] + a
    t = w >> 1  # byte 2
    a = nibble_float(t, 0) * l2[None, :] + a
    a = nibble_float(t, 1) * h2[None, :] + a
    t = w >> 9  # byte 3
    a = nibble_float(t, 0) * l3[None, :] + a
    a = nibble_float(t, 1) * h3[None, :] + a
    part = tl.sum(tl.reshape(a, (w.shape[0], w.shape[1] // (G // 8), G // 8)), 2)
    return s.to(tl.float32) * (part - offset[None, :]) + z.to(tl.float32) * total[None, :]


# ---- int4 codes times 8-bit inputs (A8, a draft's one-token products) ---------------------------------------------
#
# The word kernel above makes each code a float and multiplies it by its input: about four instructions a weight on
# sm_90, the H200's budget at its bandwidth (docs/quantization.md). A8 multiplies the codes by the inputs rounded to
# 8 bits instead, four at a time in one integer dot product (`dp4a`): each group of G inputs gets its own scale (its
# largest magnitude over 127), so an input moves by at most half its group's step; the low nibbles of a word, masked
# in place (one LOP3), are four unsigned bytes against the four inputs they multiply, the high nibbles the same after
# a shift. A group's sum of codes x rounded inputs is an exact integer. This changes the products, so it is for a
# draft only (any draft keeps the answer exact; acceptance may move), never a served target.


@triton.jit
def dp4a(a, b, c):
    """c + the dot product of a's four unsigned bytes with b's four signed ones (int32 each): one instruction on a
    GPU (dp4a.u32.s32), four products and their sum in Triton's interpreter."""
    if _ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    out = c
    for j in tl.static_range(4):
        out += ((a >> (8 * j)) & 0xFF) * ((b << (24 - 8 * j)) >> 24)
    return out


@triton.jit
def signed_byte(x, inv, shift: tl.constexpr):
    """round(x * inv) (|x * inv| <= 127.5) as a byte at bit `shift` of an int32: the float 1.5 * 2^23 + v holds v's
    two's complement in its low mantissa bits, rounded to nearest even, so its low byte is v's."""
    v = (x * inv + 12582912.0).to(tl.int32, bitcast=True) & 0xFF
    return v << shift


@triton.jit
def int4_inputs_a8(x_ptr, nw_ptr, k0, K, sq, NORM: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """One token's inputs for a tile of int4 words, rounded to 8 bits a group: the inputs of each word's low and
    high nibbles as four signed bytes (int32 [BLOCK_K / 8] each), per group [BLOCK_K / G] its step (largest
    magnitude / 127) and its inputs' exact sum, and the running sum of squares."""
    l0, l1, l2, l3, h0, h1, h2, h3, sq = word_inputs(x_ptr, nw_ptr, k0, K, sq, NORM, BLOCK_K, G)
    groups: tl.constexpr = BLOCK_K // G
    big = tl.maximum(tl.maximum(tl.maximum(tl.abs(l0), tl.abs(l1)), tl.maximum(tl.abs(l2), tl.abs(l3))),
                     tl.maximum(tl.maximum(tl.abs(h0), tl.abs(h1)), tl.maximum(tl.abs(h2), tl.abs(h3))))
    top = tl.max(tl.reshape(big, (groups, G // 8)), 1)
    step = top / 127.0
    inv_g = 127.0 / tl.maximum(top, 1e-30)  # (a group of zeros, or past K: every input 0 either way)
    inv = tl.reshape(tl.broadcast_to(inv_g[:, None], (groups, G // 8)), (BLOCK_K // 8,))
    xl = signed_byte(l0, inv, 0) | signed_byte(l1, inv, 8) | signed_byte(l2, inv, 16) | signed_byte(l3, inv, 24)
    xh = signed_byte(h0, inv, 0) | signed_byte(h1, inv, 8) | signed_byte(h2, inv, 16) | signed_byte(h3, inv, 24)
    total = tl.sum(tl.reshape(l0 + l1 + l2 + l3 + h0 + h1 + h2 + h3, (groups, G // 8)), 1)
    return xl, xh, step, total, sq


@triton.jit
def int4_word_sums_a8(w, s, z, xl, xh, step, total, G: tl.constexpr):
    """Each group's share of a one-token product with 8-bit inputs, [rows, groups]: s step sum(q xq) + (z - 8 s)
    sum(x), the codes' sums exact integers (two dp4a a word)."""
    d = dp4a(w & 0x0F0F0F0F, xl[None, :], dp4a((w >> 4) & 0x0F0F0F0F, xh[None, :], 0))
    part = tl.sum(tl.reshape(d, (w.shape[0], w.shape[1] // (G // 8), G // 8)), 2).to(tl.float32)
    s = s.to(tl.float32)
    return s * step[None, :] * part + (z.to(tl.float32) - 8.0 * s) * total[None, :]


@triton.jit
def int4_tile_dot(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, xl, xh, acc, BN: tl.constexpr, BLOCK_K: tl.constexpr,
                  G: tl.constexpr, PRECISION: tl.constexpr):
    """acc + an M-token product's share of inputs k0..k0 + BLOCK_K - 1 (whole groups). The tile is loaded as stored
    (`weight_tile`: bytes [rows, groups, G / 2], a scale and an offset a group), de-quantised (w = (q - 8) s + z,
    rounded once) and laid flat: flat byte i holds the codes of input k0 + (i // (G / 2)) G + i % (G / 2) (low
    nibble) and of the one G / 2 after it (high), so the groups' first and second halves are two tensor-core
    operands [rows, BLOCK_K / 2], each with its inputs xl, xh [BLOCK_K / 2, MP]."""
    w, s, z = weight_tile(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, BLOCK_K, 2, G)
    s = s.to(tl.float32)[:, :, None]
    z = z.to(tl.float32)[:, :, None]
    lo = tl.reshape((exact_float(w & 15, 8) * s + z).to(xl.dtype), (BN, BLOCK_K // 2))
    hi = tl.reshape((exact_float(w >> 4, 8) * s + z).to(xl.dtype), (BN, BLOCK_K // 2))
    acc = tl.dot(lo, xl, acc, input_precision=PRECISION)
    return tl.dot(hi, xh, acc, input_precision=PRECISION)


@triton.jit
def accumulators(ROWS: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr):
    """A one-token product's two running sums (fp32, a column each, or for int4 a group each) and its inputs'
    running sum of squares (a column each, or for int4 a word each, as `int4_inputs` loads them)."""
    if QUANT == 2:
        acc = tl.zeros([ROWS, BLOCK_K // G], tl.float32)
        sq = tl.zeros([BLOCK_K // 8], tl.float32)
    else:
        acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
        sq = tl.zeros([BLOCK_K], tl.float32)
    return acc, acc, sq


@triton.jit
def row_scales(s_ptr, rows, rm, QUANT: tl.constexpr):
    """int8's per-row scales (fp32 [rows]); exactly 1 otherwise (nothing is read)."""
    return tl.load(s_ptr + rows, mask=rm & (QUANT == 1), other=1.0).to(tl.float32)


@triton.jit
def tiles_at(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, N, EPILOGUE: tl.constexpr, BLOCK_K: tl.constexpr,
             QUANT: tl.constexpr, G: tl.constexpr):
    """A product's weight tile of inputs k0.., and for SILU_MUL the up projection's (rows N.. of the weight), each
    with its scales and offsets, int4 as one token reads it: the first one loaded before the wait for the previous
    kernel, each next one a step ahead of its use."""
    w, ws, wz = one_token_tile(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, BLOCK_K, QUANT, G)
    u, us, uz = w, ws, wz
    if EPILOGUE == 1:
        u, us, uz = one_token_tile(w_ptr, s_ptr, z_ptr, rows + N, rm, k0, K, BLOCK_K, QUANT, G)
    return w, ws, wz, u, us, uz


@triton.jit
def one_token_tile(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, BLOCK_K: tl.constexpr, QUANT: tl.constexpr,
                   G: tl.constexpr):
    """A one-token product's weight tile: int4 as words (`int4_words`), the rest as stored (`weight_tile`)."""
    if QUANT == 2:
        return int4_words(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, BLOCK_K, G)
    else:
        return weight_tile(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, BLOCK_K, QUANT, G)


@triton.jit
def store_epilogue(out, ok, y, up, like_ptr, EPILOGUE: tl.constexpr):
    """ADD (0): out += y; SILU_MUL (1): out = SiLU(y) * up; LOGITS (2): out = y, fp32. Each rounded to the model's
    dtype (like_ptr's) where the transformers model rounds; RAW (3): out = y, fp32, unrounded (for rope_rows).
    Returns what it wrote, as fp32."""
    dtype = like_ptr.dtype.element_ty
    if EPILOGUE != 3:
        y = y.to(dtype).to(tl.float32)
    if EPILOGUE == 0:  # the residual stream, in place
        h = tl.load(out, mask=ok, other=0.0).to(tl.float32)
        written = (h + y).to(dtype)
    elif EPILOGUE == 1:
        up = up.to(dtype).to(tl.float32)
        silu = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)
        written = (silu * up).to(dtype)
    else:
        written = y
    tl.store(out, written, mask=ok)
    return written.to(tl.float32)


@triton.jit
def product_rn(a, b):
    """a * b in fp32, rounded, as a multiply of its own: left to itself the compiler contracts a product and the add
    after it into one FMA, which skips the product's rounding (and, once the roundings to half precision around it
    are folded, does it in half precision: fma.rn.f16x2, seen in sm_90's PTX), so two kernels with the same source
    rounded differently."""
    if _ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return a * b


@triton.jit
def rotary(ya, yb, ca, cb, sa, sb, rotate, like_ptr):
    """A head's two halves, rounded to like_ptr's dtype: for q and k (`rotate`: a program's, or each row's)
    x * cos + rotate_half(x) * sin, each term rounded as transformers rounds it (`product_rn`: no FMA skips a
    rounding); for v as they are."""
    dtype = like_ptr.dtype.element_ty
    out_a = (product_rn(ya, ca).to(dtype).to(tl.float32) + product_rn(-yb, sa).to(dtype).to(tl.float32)).to(dtype)
    out_b = (product_rn(yb, cb).to(dtype).to(tl.float32) + product_rn(ya, sb).to(dtype).to(tl.float32)).to(dtype)
    return tl.where(rotate, out_a, ya.to(dtype)), tl.where(rotate, out_b, yb.to(dtype))


@triton.jit
def qkv_rope(h_ptr, nw_ptr, eps, w_ptr, s_ptr, z_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, K,
             kv_stride, HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
             BH: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
             A8: tl.constexpr = False):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    head = tl.program_id(0)  # q heads, then k heads, then v heads
    j = tl.program_id(1) * BH + tl.arange(0, BH)  # a block of the first half of the head's dimensions
    rows_a = head * D + j
    rows_b = rows_a + D // 2  # their rotary partners
    every = j >= 0
    wa, sa_, za = one_token_tile(w_ptr, s_ptr, z_ptr, rows_a, every, 0, K, BLOCK_K, QUANT, G)
    wb, sb_, zb = one_token_tile(w_ptr, s_ptr, z_ptr, rows_b, every, 0, K, BLOCK_K, QUANT, G)
    ra = row_scales(s_ptr, rows_a, every, QUANT)
    rb = row_scales(s_ptr, rows_b, every, QUANT)
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
    acc_a, acc_b, sq = accumulators(BH, BLOCK_K, QUANT, G)
    for k0 in range(0, K, BLOCK_K):
        wa_next, sa_next, za_next = one_token_tile(w_ptr, s_ptr, z_ptr, rows_a, every, k0 + BLOCK_K, K, BLOCK_K,
                                                   QUANT, G)
        wb_next, sb_next, zb_next = one_token_tile(w_ptr, s_ptr, z_ptr, rows_b, every, k0 + BLOCK_K, K, BLOCK_K,
                                                   QUANT, G)
        # two tiles of rows, as gate/up's (EPILOGUE 1 sums the second), over the normed input (NORM True)
        acc_a, acc_b, sq = one_token_sums(h_ptr, nw_ptr, k0, K, wa, sa_, za, wb, sb_, zb, acc_a, acc_b, sq, True, 1,
                                          BLOCK_K, QUANT, G, A8)
        wa, sa_, za = wa_next, sa_next, za_next
        wb, sb_, zb = wb_next, sb_next, zb_next
    r = tl.rsqrt(tl.sum(sq, 0) / K + eps)  # RMSNorm's scale, applied after the sum
    ya = tl.sum(acc_a, 1) * ra * r
    yb = tl.sum(acc_b, 1) * rb * r
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
def one_token_sums(x_ptr, nw_ptr, k0, K, w, ws, wz, u, us, uz, acc, acc_up, sq, NORM: tl.constexpr,
                   EPILOGUE: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
                   A8: tl.constexpr = False):
    """A one-token product's running sums (and the up projection's, and its inputs' squares) with the weight tile
    of inputs k0.. added; int4 codes with A8 times the inputs rounded to 8 bits (`int4_word_sums_a8`)."""
    if QUANT == 2 and A8:
        xl, xh, step, total, sq = int4_inputs_a8(x_ptr, nw_ptr, k0, K, sq, NORM, BLOCK_K, G)
        acc += int4_word_sums_a8(w, ws, wz, xl, xh, step, total, G)
        if EPILOGUE == 1:
            acc_up += int4_word_sums_a8(u, us, uz, xl, xh, step, total, G)
    elif QUANT == 2:
        l0, l1, l2, l3, h0, h1, h2, h3, total, offset, sq = int4_inputs(x_ptr, nw_ptr, k0, K, sq, NORM, BLOCK_K, G)
        acc += int4_word_sums(w, ws, wz, l0, l1, l2, l3, h0, h1, h2, h3, total, offset, G)
        if EPILOGUE == 1:
            acc_up += int4_word_sums(u, us, uz, l0, l1, l2, l3, h0, h1, h2, h3, total, offset, G)
    else:
        ks = tl.arange(0, BLOCK_K)
        km = k0 + ks < K
        x = tl.load(x_ptr + k0 + ks, mask=km, other=0.0).to(tl.float32)
        if NORM:
            sq += x * x
            x = x * tl.load(nw_ptr + k0 + ks, mask=km, other=0.0).to(tl.float32)
        acc += as_float(w) * x[None, :]
        if EPILOGUE == 1:
            acc_up += as_float(u) * x[None, :]
    return acc, acc_up, sq


@triton.jit
def first_block(w_ptr, s_ptr, z_ptr, block, N, K, EPILOGUE: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr):
    """How a one-token product's program starts, on row block `block`: it lets the next kernel start (PDL), loads
    the block's first weight tile (and the up projection's) and int8's row scales -- weights no kernel writes --
    and only then waits for the previous kernel. Returns the block's rows, their mask, the tiles and the scales."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = block * BN + tl.arange(0, BN)
    rm = rows < N
    w, ws, wz, u, us, uz = tiles_at(w_ptr, s_ptr, z_ptr, rows, rm, 0, K, N, EPILOGUE, BLOCK_K, QUANT, G)
    rw = row_scales(s_ptr, rows, rm, QUANT)
    ru = row_scales(s_ptr, rows + N, rm & (EPILOGUE == 1), QUANT)
    if PDL:
        tl.extra.cuda.gdc_wait()
    return rows, rm, w, ws, wz, u, us, uz, rw, ru


@triton.jit
def gemv(x_ptr, nw_ptr, eps, w_ptr, s_ptr, z_ptr, out_ptr, N, K,
         NORM: tl.constexpr, EPILOGUE: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
         QUANT: tl.constexpr, G: tl.constexpr, A8: tl.constexpr = False):
    rows, rm, w, ws, wz, u, us, uz, rw, ru = first_block(w_ptr, s_ptr, z_ptr, tl.program_id(0), N, K, EPILOGUE, BN,
                                                         BLOCK_K, PDL, QUANT, G)
    acc, acc_up, sq = accumulators(BN, BLOCK_K, QUANT, G)
    for k0 in range(0, K, BLOCK_K):
        w_next, ws_next, wz_next, u_next, us_next, uz_next = tiles_at(w_ptr, s_ptr, z_ptr, rows, rm, k0 + BLOCK_K,
                                                                      K, N, EPILOGUE, BLOCK_K, QUANT, G)
        acc, acc_up, sq = one_token_sums(x_ptr, nw_ptr, k0, K, w, ws, wz, u, us, uz, acc, acc_up, sq, NORM, EPILOGUE,
                                         BLOCK_K, QUANT, G, A8)
        w, ws, wz = w_next, ws_next, wz_next
        u, us, uz = u_next, us_next, uz_next
    store_row(out_ptr, x_ptr, 1, N, K, 0, rows, rm, acc, acc_up, sq, rw, ru, eps, NORM, EPILOGUE)


@triton.jit
def gemv_stream(x_ptr, nw_ptr, eps, w_ptr, s_ptr, z_ptr, out_ptr, N, K,
                NORM: tl.constexpr, EPILOGUE: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, A8: tl.constexpr = False):
    """`gemv` in fewer programs than row blocks (kernels.STREAM): program p of P takes blocks p, p + P, p + 2P, ...
    as one run of tiles, each loaded a step ahead of its use, the next block's first tile too, so its loads do not
    stop between blocks. A row is summed tile by tile in `gemv`'s order, so both write the same bits."""
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = tl.cdiv(K, BLOCK_K)
    steps = tl.cdiv(tl.cdiv(N, BN) - p, programs) * tiles  # this program's blocks x their tiles
    rows, rm, w, ws, wz, u, us, uz, rw, ru = first_block(w_ptr, s_ptr, z_ptr, p, N, K, EPILOGUE, BN, BLOCK_K, PDL,
                                                         QUANT, G)
    acc, acc_up, sq = accumulators(BN, BLOCK_K, QUANT, G)
    for step in range(0, steps):
        k0 = (step % tiles) * BLOCK_K
        ahead = step + 1  # the tile loaded now, used next step: this block's next, or the next block's first
        rows_ahead = (p + (ahead // tiles) * programs) * BN + tl.arange(0, BN)
        # (after the last step: the rows of a block past the last, all masked)
        w_next, ws_next, wz_next, u_next, us_next, uz_next = tiles_at(w_ptr, s_ptr, z_ptr, rows_ahead, rows_ahead < N,
                                                                      (ahead % tiles) * BLOCK_K, K, N, EPILOGUE,
                                                                      BLOCK_K, QUANT, G)
        acc, acc_up, sq = one_token_sums(x_ptr, nw_ptr, k0, K, w, ws, wz, u, us, uz, acc, acc_up, sq, NORM, EPILOGUE,
                                         BLOCK_K, QUANT, G, A8)
        if k0 + BLOCK_K >= K:  # the block's last tile: its rows out, and on to the next block
            store_row(out_ptr, x_ptr, 1, N, K, 0, rows, rm, acc, acc_up, sq, rw, ru, eps, NORM, EPILOGUE)
            acc, acc_up, sq = accumulators(BN, BLOCK_K, QUANT, G)
            rows = rows_ahead
            rm = rows < N
            rw = row_scales(s_ptr, rows, rm, QUANT)
            ru = row_scales(s_ptr, rows + N, rm & (EPILOGUE == 1), QUANT)
        w, ws, wz = w_next, ws_next, wz_next
        u, us, uz = u_next, us_next, uz_next


# ---- the fused forward of 2-4 tokens over packed weights (a draft's catch-up, a tree's frontier) -----------------
#
# The one-token kernel's loop, run for MT (2 or 4) tokens over each weight tile it loads: every token has its
# own running sums, in the one-token kernel's layouts (a [rows, groups] tile of int4 group sums, int8's / fp8's
# products summed over runs of 16 inputs each thread holds), so the tile is read from memory once for all of them
# and each token adds one multiply-add a weight on the CUDA cores. The tensor-core kernel below needs a tile of 16
# tokens and de-quantised operands laid out for the tensor cores, which cost the 1B's 2-16-token forwards 3.5-3.9
# ms with int4 codes and 1.9-2.1 with int8 on an H100 against 0.68 for a one-token step (benchmarks/h100/session19/).
# With it (H100, session 20, benchmarks/h100/session20/): the 1B's int8 / int4 forward of 2 tokens 0.89 / 1.07 ms
# against 2.10 / 3.77 on the tensor cores, of 4 tokens 1.57 / 2.07 against 2.03 / 3.65; of 5-8 (padded to 8) it took
# 2.7-2.9 / 3.9-4.3 against 2.0 / 3.6, so past 4 tokens the tensor cores take them (kernels.MAX_FEW_TOKENS). (A
# first version with a token axis in its tiles, [MT, rows, inputs], took 1.6-16 ms: Triton laid those tiles out anew
# every iteration.)


@triton.jit
def few_zeros(BN: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr):
    """A token's running sums (a product's and the up projection's) and its inputs' running sum of squares."""
    if QUANT == 2:
        acc = tl.zeros([BN, BLOCK_K // G], tl.float32)
        sq = tl.zeros([BLOCK_K // 8], tl.float32)
    else:
        acc = tl.zeros([BN, BLOCK_K // 16], tl.float32)
        sq = tl.zeros([BLOCK_K], tl.float32)
    return acc, acc, sq


@triton.jit
def token_live(m, M):
    """Whether token m (a constant) is one of the M, as a [1] mask. (m < M itself: Triton 3.9's interpreter keeps
    its data int32 under an int1 type, and a load refuses that mask.)"""
    return tl.full((1,), m, tl.int32) < M


@triton.jit
def few_token(x_ptr, nw_ptr, k0, K, M, m, w, ws, wz, u, us, uz, acc, acc_up, sq, EPILOGUE: tl.constexpr,
              XD: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr):
    """Token m's share of a tile (nothing past the M tokens: their inputs load as zeros)."""
    if QUANT == 2:
        l0, l1, l2, l3, h0, h1, h2, h3, total, offset, sq = int4_few_inputs(x_ptr, nw_ptr, k0, K, sq, NORM, BLOCK_K,
                                                                            G, m, M, XD)
        acc += int4_word_sums(w, ws, wz, l0, l1, l2, l3, h0, h1, h2, h3, total, offset, G)
        if EPILOGUE == 1:
            acc_up += int4_word_sums(u, us, uz, l0, l1, l2, l3, h0, h1, h2, h3, total, offset, G)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        ok = (ks < K) & token_live(m, M)
        x = tl.load(x_ptr + token_at(ks, m, M, K, XD), mask=ok, other=0.0).to(tl.float32)
        if NORM:
            sq += x * x
            x = x * tl.load(nw_ptr + ks, mask=ok, other=0.0).to(tl.float32)
        acc += run_sums(as_float(w) * x[None, :])
        if EPILOGUE == 1:
            acc_up += run_sums(as_float(u) * x[None, :])
    return acc, acc_up, sq


@triton.jit
def int4_quad(x_ptr, nw_ptr, k0, K, HIGH: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr,
              G: tl.constexpr, m, M, XD: tl.constexpr):
    """Token m's inputs of the four low (HIGH 0) or high codes of each word of a tile, [BLOCK_K / 8, 4] fp32, four
    neighbouring inputs a word, read together: as read and times RMSNorm's weight with NORM."""
    wi = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    at = ((wi // (G // 8)) * G + (wi % (G // 8)) * 4 + HIGH * (G // 2))[:, None] + tl.arange(0, 4)[None, :]
    ok = ((wi < K // 8) & token_live(m, M))[:, None]
    x = tl.load(x_ptr + token_at(at, m, M, K, XD), mask=ok, other=0.0).to(tl.float32)
    xn = x
    if NORM:
        xn = x * tl.load(nw_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return x, xn


@triton.jit
def quarters(v):
    """[W, 4] -> its four columns, [W] each."""
    even, odd = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))  # columns 0, 2 and 1, 3
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def int4_few_inputs(x_ptr, nw_ptr, k0, K, sq, NORM: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr,
                    m, M, XD: tl.constexpr):
    """`int4_inputs` for token m of a few: the same values, each word's four low and four high inputs read as two
    vectors (`int4_quad`) rather than eight scalars, which a few tokens' loads would multiply."""
    rl, low = int4_quad(x_ptr, nw_ptr, k0, K, 0, NORM, BLOCK_K, G, m, M, XD)
    rh, high = int4_quad(x_ptr, nw_ptr, k0, K, 1, NORM, BLOCK_K, G, m, M, XD)
    if NORM:
        sq += tl.sum(rl * rl + rh * rh, 1)
    l0, l1, l2, l3 = quarters(low)
    h0, h1, h2, h3 = quarters(high * 0.0625)
    low_sum = tl.sum(low, 1)
    high_sum = tl.sum(high, 1)
    groups: tl.constexpr = BLOCK_K // G
    total = tl.sum(tl.reshape(low_sum + high_sum, (groups, G // 8)), 1)
    offset = tl.sum(tl.reshape(264.0 * low_sum + 24.0 * high_sum, (groups, G // 8)), 1)
    return l0, l1, l2, l3, h0, h1, h2, h3, total, offset, sq


@triton.jit
def run_sums(a):
    """A tile's products [rows, inputs] summed over runs of 16 inputs, [rows, inputs / 16]."""
    return tl.sum(tl.reshape(a, (a.shape[0], a.shape[1] // 16, 16)), 2)


@triton.jit
def store_row(out_ptr, x_ptr, M, N, K, m, rows, rm, acc, acc_up, sq, rw, ru, eps, NORM: tl.constexpr,
              EPILOGUE: tl.constexpr):
    """Token m's row of out [M, N] (nothing past the M tokens) from its running sums: summed, int8's row scales,
    RMSNorm's scale (applied after the sum), the epilogue. One token: m 0 of M 1."""
    y = tl.sum(acc, 1) * rw
    up = tl.sum(acc_up, 1) * ru
    if NORM:  # RMSNorm's scale, applied after the sum
        r = tl.rsqrt(tl.sum(sq, 0) / K + eps)
        y = y * r
        up = up * r
    store_epilogue(out_ptr + m * N + rows, rm & token_live(m, M), y, up, x_ptr, EPILOGUE)


@triton.jit
def gemv_few(x_ptr, nw_ptr, eps, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K,
             NORM: tl.constexpr, EPILOGUE: tl.constexpr, XD: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr,
             MT: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr):
    """`gemv` for M <= MT tokens (MT 2 or 4) over packed weights (QUANT 1 or 2): out [M, N] as `gemv_rows` writes
    it."""
    tl.static_assert((MT == 2) | (MT == 4))
    rows, rm, w, ws, wz, u, us, uz, rw, ru = first_block(w_ptr, s_ptr, z_ptr, tl.program_id(0), N, K, EPILOGUE, BN,
                                                         BLOCK_K, PDL, QUANT, G)
    a0, b0, q0 = few_zeros(BN, BLOCK_K, QUANT, G)  # token m's: a (the product), b (the up projection), q (squares)
    a1, b1, q1 = a0, b0, q0
    a2, b2, q2 = a0, b0, q0
    a3, b3, q3 = a0, b0, q0
    for k0 in range(0, K, BLOCK_K):
        w_next, ws_next, wz_next, u_next, us_next, uz_next = tiles_at(w_ptr, s_ptr, z_ptr, rows, rm, k0 + BLOCK_K,
                                                                      K, N, EPILOGUE, BLOCK_K, QUANT, G)
        a0, b0, q0 = few_token(x_ptr, nw_ptr, k0, K, M, 0, w, ws, wz, u, us, uz, a0, b0, q0, EPILOGUE, XD,
                               NORM, BLOCK_K, QUANT, G)
        a1, b1, q1 = few_token(x_ptr, nw_ptr, k0, K, M, 1, w, ws, wz, u, us, uz, a1, b1, q1, EPILOGUE, XD,
                               NORM, BLOCK_K, QUANT, G)
        if MT > 2:
            a2, b2, q2 = few_token(x_ptr, nw_ptr, k0, K, M, 2, w, ws, wz, u, us, uz, a2, b2, q2, EPILOGUE, XD,
                                   NORM, BLOCK_K, QUANT, G)
            a3, b3, q3 = few_token(x_ptr, nw_ptr, k0, K, M, 3, w, ws, wz, u, us, uz, a3, b3, q3, EPILOGUE, XD,
                                   NORM, BLOCK_K, QUANT, G)
        w, ws, wz = w_next, ws_next, wz_next
        u, us, uz = u_next, us_next, uz_next
    store_row(out_ptr, x_ptr, M, N, K, 0, rows, rm, a0, b0, q0, rw, ru, eps, NORM, EPILOGUE)
    store_row(out_ptr, x_ptr, M, N, K, 1, rows, rm, a1, b1, q1, rw, ru, eps, NORM, EPILOGUE)
    if MT > 2:
        store_row(out_ptr, x_ptr, M, N, K, 2, rows, rm, a2, b2, q2, rw, ru, eps, NORM, EPILOGUE)
        store_row(out_ptr, x_ptr, M, N, K, 3, rows, rm, a3, b3, q3, rw, ru, eps, NORM, EPILOGUE)


# ---- the fused forward of 2-64 tokens (a verify pass, a token tree, a draft's catch-up) ---------------------------
#
# The same products for M <= MP tokens at once. Each program owns BN output rows, as above, and reads every weight
# once for all M tokens: the weight tile [BN, BLOCK_K] is the left operand of a tensor-core product with the tokens'
# inputs [BLOCK_K, MP] (M padded to MP = 16, 32 or 64 columns; 16 is the smallest tile a tensor core takes), so the
# weight stays in its own row-major layout and the loop is the plain one Triton software-pipelines (`num_stages`).
# The first iteration is peeled: its weight tile is loaded before the wait for the previous kernel (PDL).


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
def dot_operand(w, like_ptr, QUANT: tl.constexpr):
    """A stored model-dtype, int8 or fp8 tile as a tensor-core operand in the model's dtype (like_ptr's): int8 codes
    are integers of at most 127 and fp8 values have 4 significant bits, exact in bf16, fp16 and fp32. Converted
    directly, not through `exact_float` as the CUDA-core kernels do: the same operand, and on an H100 the 1B's int8
    forwards of 5 / 8 / 16 tokens took 1.87 / 1.85 / 1.76 ms against 2.07 / 2.00 / 1.85 (session 23, one call)."""
    if QUANT == 0:
        return w
    return w.to(like_ptr.dtype.element_ty)


@triton.jit
def gemv_rows(x_ptr, nw_ptr, eps, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, KSPAN,
              NORM: tl.constexpr, EPILOGUE: tl.constexpr, XD: tl.constexpr, BN: tl.constexpr,
              BLOCK_K: tl.constexpr, MP: tl.constexpr, PDL: tl.constexpr, PRECISION: tl.constexpr,
              QUANT: tl.constexpr, G: tl.constexpr, SPLITS: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = rows < N
    ms = tl.arange(0, MP)
    mm = ms < M
    acc, acc_up, sq, rw, ru = rows_sums(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, rows, rm, ms, mm, M, N, K, KSPAN, NORM,
                                        EPILOGUE, XD, BN, BLOCK_K, MP, PDL, PRECISION, QUANT, G)
    if SPLITS == 1:
        rows_epilogue(out_ptr, acc, acc_up, sq, rw, ru, rows, rm, ms, mm, N, K, eps, x_ptr, NORM, EPILOGUE)
    else:
        acc, acc_up, sq, last = split_sums(part_ptr, count_ptr, acc, acc_up, sq, ms, EPILOGUE, BN, MP, SPLITS)
        if last:
            rows_epilogue(out_ptr, acc, acc_up, sq, rw, ru, rows, rm, ms, mm, N, K, eps, x_ptr, NORM, EPILOGUE)


@triton.jit
def rows_sums(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, rows, rm, ms, mm, M, N, K, KSPAN, NORM: tl.constexpr,
              EPILOGUE: tl.constexpr, XD: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr, MP: tl.constexpr,
              PDL: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr):
    """An M-token product's sums over this program's inputs (split s ways: the s-th part, KSPAN inputs) for the
    weight rows `rows` (any rows: `qkv_rows` takes rotary pairs): [BN, MP] fp32 (and the up projection's, for
    SILU_MUL), the inputs' sums of squares [MP] and the rows' scales; the first weight tile and the scales loaded
    before the wait for the previous kernel."""
    ks = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * KSPAN  # this program's inputs: k_lo..k_hi - 1 (all of them, unsplit)
    k_hi = tl.minimum(K, k_lo + KSPAN)
    if QUANT != 2:
        w, ws, wz, u, us, uz = tiles_at(w_ptr, s_ptr, z_ptr, rows, rm, k_lo, K, N, EPILOGUE, BLOCK_K, QUANT, G)
    rw = row_scales(s_ptr, rows, rm, QUANT)
    ru = row_scales(s_ptr, rows + N, rm & (EPILOGUE == 1), QUANT)
    if PDL:
        tl.extra.cuda.gdc_wait()
    sq = tl.zeros([MP], tl.float32)
    if QUANT == 2:  # BLOCK_K inputs (whole groups) a step: their groups' first and second halves, two products
        i = tl.arange(0, BLOCK_K // 2)
        lo_k = (i // (G // 2)) * G + i % (G // 2)  # the input of each byte's low nibble, from the tile's start
        acc = tl.zeros([BN, MP], tl.float32)
        acc_up = tl.zeros([BN, MP], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            xl, sq = normed_tile(x_ptr, nw_ptr, k0 + lo_k, ms, mm, K, M, sq, XD, NORM)
            xh, sq = normed_tile(x_ptr, nw_ptr, k0 + lo_k + G // 2, ms, mm, K, M, sq, XD, NORM)
            acc = int4_tile_dot(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, xl, xh, acc, BN, BLOCK_K, G, PRECISION)
            if EPILOGUE == 1:
                acc_up = int4_tile_dot(w_ptr, s_ptr, z_ptr, rows + N, rm, k0, K, xl, xh, acc_up, BN, BLOCK_K, G,
                                       PRECISION)
    else:
        x, sq = normed_tile(x_ptr, nw_ptr, k_lo + ks, ms, mm, K, M, sq, XD, NORM)
        acc = tl.dot(dot_operand(w, x_ptr, QUANT), x, input_precision=PRECISION)  # [BN, MP], fp32
        acc_up = acc
        if EPILOGUE == 1:
            acc_up = tl.dot(dot_operand(u, x_ptr, QUANT), x, input_precision=PRECISION)
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            x, sq = normed_tile(x_ptr, nw_ptr, k0 + ks, ms, mm, K, M, sq, XD, NORM)
            w, ws, wz = weight_tile(w_ptr, s_ptr, z_ptr, rows, rm, k0, K, BLOCK_K, QUANT, G)
            acc = tl.dot(dot_operand(w, x_ptr, QUANT), x, acc, input_precision=PRECISION)
            if EPILOGUE == 1:
                u, us, uz = weight_tile(w_ptr, s_ptr, z_ptr, rows + N, rm, k0, K, BLOCK_K, QUANT, G)
                acc_up = tl.dot(dot_operand(u, x_ptr, QUANT), x, acc_up, input_precision=PRECISION)
    return acc, acc_up, sq, rw, ru


@triton.jit
def split_sums(part_ptr, count_ptr, acc, acc_up, sq, ms, EPILOGUE: tl.constexpr, BN: tl.constexpr,
               MP: tl.constexpr, SPLITS: tl.constexpr):
    """A product split over its inputs (one of few rows, whose row blocks alone would leave multiprocessors idle):
    each program stores its partial sums; the row block's last program to finish adds them up, in the splits'
    order (the same result whichever finishes last). Returns the sums and whether this program is that last one
    (the others' sums are their own part: not to be used)."""
    block = tl.program_id(0)
    cell = (block * SPLITS + tl.program_id(1)) * (2 * BN * MP + MP)  # [acc | acc_up | sq] of each program
    at = tl.arange(0, BN)[:, None] * MP + ms[None, :]
    tl.store(part_ptr + cell + at, acc)
    if EPILOGUE == 1:
        tl.store(part_ptr + cell + BN * MP + at, acc_up)
    tl.store(part_ptr + cell + 2 * BN * MP + ms, sq)
    last = last_to_finish(count_ptr + block, SPLITS)
    if last:
        acc = tl.zeros([BN, MP], tl.float32)
        acc_up = tl.zeros([BN, MP], tl.float32)
        sq = tl.zeros([MP], tl.float32)
        for j in tl.static_range(SPLITS):
            cell = (block * SPLITS + j) * (2 * BN * MP + MP)
            acc += tl.load(part_ptr + cell + at, cache_modifier=".cg")
            if EPILOGUE == 1:
                acc_up += tl.load(part_ptr + cell + BN * MP + at, cache_modifier=".cg")
            sq += tl.load(part_ptr + cell + 2 * BN * MP + ms, cache_modifier=".cg")
    return acc, acc_up, sq, last


@triton.jit
def rows_epilogue(out_ptr, acc, acc_up, sq, rw, ru, rows, rm, ms, mm, N, K, eps, x_ptr, NORM: tl.constexpr,
                  EPILOGUE: tl.constexpr):
    """An M-token product's sums [BN, MP] scaled (int8's row scales, RMSNorm's per token) into out [M, N]."""
    y = acc * rw[:, None]
    up = acc_up * ru[:, None]
    if NORM:  # RMSNorm's scale, per token, applied after the sum
        r = tl.rsqrt(sq / K + eps)
        y = y * r[None, :]
        up = up * r[None, :]
    store_epilogue(out_ptr + ms[None, :] * N + rows[:, None], rm[:, None] & mm[None, :], y, up, x_ptr, EPILOGUE)


@triton.jit
def rope_rows(y_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, M, kv_stride, y_stride,
              HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, MP: tl.constexpr,
              PDL: tl.constexpr):
    """The q/k/v product's epilogue for M tokens, one program a head: y [M, (HEADS + 2 KV) * D] (rows y_stride
    apart; fp32 from `gemv_rows`, RMSNorm's scale applied, or the library's product in x's dtype) + bias, rounded;
    rotary embedding on q and k; q out head-major [HEADS, M, D], k and v into the caches at pos + m. The same
    arithmetic as qkv_rope's epilogue, and as `qkv_rows`, which has it in the product."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    head = tl.program_id(0)  # q heads, then k heads, then v heads
    j = tl.arange(0, D // 2)
    ms = tl.arange(0, MP)
    ok = (j >= 0)[:, None] & (ms < M)[None, :]
    table = (tl.load(pos_ptr) + ms)[None, :] * D + j[:, None]  # each token's position's rotary row [D / 2, MP]
    ca, cb, sa, sb, ba, bb = rope_operands(b_ptr, cos_ptr, sin_ptr, table, head, j, j >= 0, ok, D, HAS_BIAS)
    if PDL:
        tl.extra.cuda.gdc_wait()
    y = y_ptr + ms[None, :] * y_stride + head * D + j[:, None]
    rope_epilogue(tl.load(y, mask=ok, other=0.0), tl.load(y + D // 2, mask=ok, other=0.0), ca, cb, sa, sb, ba, bb,
                  head, j, ok, ms, table, q_ptr, kc_ptr, vc_ptr, M, kv_stride, HEADS, KV, D)


@triton.jit
def rope_operands(b_ptr, cos_ptr, sin_ptr, table, head, j, rok, ok, D: tl.constexpr, HAS_BIAS: tl.constexpr):
    """For rotary pairs (dimension j and j + D / 2 of head `head`, [R] each or a scalar head; those of `rok`) and
    their tokens' rows of the rotary tables `table` ((pos + m) D + j, [R, MP]): the tables' cos and sin, fp32, and
    the biases [R] (zeros without). All written before a step starts: loaded before the wait for the previous
    kernel."""
    ca = tl.load(cos_ptr + table, mask=ok, other=0.0).to(tl.float32)
    cb = tl.load(cos_ptr + table + D // 2, mask=ok, other=0.0).to(tl.float32)
    sa = tl.load(sin_ptr + table, mask=ok, other=0.0).to(tl.float32)
    sb = tl.load(sin_ptr + table + D // 2, mask=ok, other=0.0).to(tl.float32)
    ba = tl.zeros(j.shape, tl.float32)
    bb = tl.zeros(j.shape, tl.float32)
    if HAS_BIAS:
        ba = tl.load(b_ptr + head * D + j, mask=rok, other=0.0).to(tl.float32)
        bb = tl.load(b_ptr + head * D + D // 2 + j, mask=rok, other=0.0).to(tl.float32)
    return ca, cb, sa, sb, ba, bb


@triton.jit
def rope_epilogue(ya, yb, ca, cb, sa, sb, ba, bb, head, j, ok, ms, table, q_ptr, kc_ptr, vc_ptr, M, kv_stride,
                  HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr):
    """The products ya, yb [R, MP] of rotary pairs (dimensions j and j + D / 2 of head `head`: [R] each, or a
    scalar head) + bias, rounded to the model's dtype (q_ptr's), rotary embedding on q and k; stored where
    `ok`: q head-major [HEADS, M, D] (the layout the attention reads), k and v into the caches at pos + m."""
    dtype = q_ptr.dtype.element_ty
    head2 = (head + tl.zeros(j.shape, tl.int32))[:, None]  # [R, 1], from a scalar head too
    ya = (ya + ba[:, None]).to(dtype).to(tl.float32)
    yb = (yb + bb[:, None]).to(dtype).to(tl.float32)
    out_a, out_b = rotary(ya, yb, ca, cb, sa, sb, head2 < HEADS + KV, q_ptr)
    q = q_ptr + (head2 * M + ms[None, :]) * D + j[:, None]
    k = kc_ptr + (head2 - HEADS) * kv_stride + table
    v = vc_ptr + (head2 - HEADS - KV) * kv_stride + table
    is_q = ok & (head2 < HEADS)
    is_k = ok & (head2 >= HEADS) & (head2 < HEADS + KV)
    is_v = ok & (head2 >= HEADS + KV)
    tl.store(q, out_a, mask=is_q)
    tl.store(q + D // 2, out_b, mask=is_q)
    tl.store(k, out_a, mask=is_k)
    tl.store(k + D // 2, out_b, mask=is_k)
    tl.store(v, out_a, mask=is_v)
    tl.store(v + D // 2, out_b, mask=is_v)


@triton.jit
def qkv_rows(x_ptr, nw_ptr, eps, w_ptr, s_ptr, z_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
             part_ptr, count_ptr, M, N, K, KSPAN, kv_stride, HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
             HAS_BIAS: tl.constexpr, NORM: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr, MP: tl.constexpr,
             PDL: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
             SPLITS: tl.constexpr):
    """The q/k/v product of M tokens (`gemv_rows`' sums, RAW) with `rope_rows`' epilogue in it, the same arithmetic
    in one kernel: a program's BN weight rows are BN / 2 rotary pairs, numbered across heads (pair p: dimension
    p % (D / 2) of head p // (D / 2)), their first halves' rows, then their partners D / 2 rows further."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    BH: tl.constexpr = BN // 2
    i = tl.arange(0, BN)
    pair = tl.program_id(0) * BH + i % BH
    rows = (pair // (D // 2)) * D + pair % (D // 2) + (i // BH) * (D // 2)
    rm = pair < N // 2
    ms = tl.arange(0, MP)
    mm = ms < M
    p = tl.program_id(0) * BH + tl.arange(0, BH)  # the pairs again, a row each: the epilogue's
    head = p // (D // 2)
    j = p % (D // 2)
    ok = (p < N // 2)[:, None] & mm[None, :]
    table = (tl.load(pos_ptr) + ms)[None, :] * D + j[:, None]  # each token's position's rotary row [BH, MP]
    ca, cb, sa, sb, ba, bb = rope_operands(b_ptr, cos_ptr, sin_ptr, table, head, j, p < N // 2, ok, D, HAS_BIAS)
    acc, _, sq, rw, _ = rows_sums(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, rows, rm, ms, mm, M, N, K, KSPAN, NORM, 3, 0,
                                  BN, BLOCK_K, MP, PDL, PRECISION, QUANT, G)
    last = True
    if SPLITS > 1:
        acc, _, sq, last = split_sums(part_ptr, count_ptr, acc, acc, sq, ms, 3, BN, MP, SPLITS)
    if last:
        # rows_epilogue's scaling, each product rounded before the bias is added, as `rope_rows` reads it (no FMA
        # of the last product with the bias), then its halves apart
        y = product_rn(acc, rw[:, None])
        if NORM:
            y = product_rn(y, tl.rsqrt(sq / K + eps)[None, :])
        ya, yb = tl.split(tl.permute(tl.reshape(y, (2, BH, MP)), (1, 2, 0)))
        rope_epilogue(ya, yb, ca, cb, sa, sb, ba, bb, head, j, ok, ms, table, q_ptr, kc_ptr, vc_ptr, M, kv_stride,
                      HEADS, KV, D)


# ---- around PyTorch's int4 kernel (tinygemm): a product of several tokens over int4 weights -----------------------


@triton.jit
def rms_normed(x, w, K, eps):
    """RMSNorm of one token's inputs x (fp32, zeros past K) times the norm's weight w: the library products' one
    rounding of a normed input (`library_input`, `library_output`'s NORM_NEXT), the same arithmetic in both."""
    return x * tl.rsqrt(tl.sum(x * x, 0) / K + eps) * w


@triton.jit
def library_input(x_ptr, nw_ptr, out_ptr, eps, M, K, NORM: tl.constexpr, XD: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    """Token m's inputs (program m) for the library's product, into out [M, K] in x's dtype: its row of x ([M, K],
    or head-major [K // XD, M, XD] with XD), with NORM RMS-normalised and times the norm's weight, rounded once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    ok = k < K
    if NORM:
        w = tl.load(nw_ptr + k, mask=ok, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK], tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + token_at(k, m, M, K, XD), mask=ok, other=0.0).to(tl.float32)
    if NORM:
        x = rms_normed(x, w, K, eps)
    tl.store(out_ptr + m * K + k, x.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def library_output(y_ptr, out_ptr, nw_ptr, normed_ptr, eps, N, ROWS, EPILOGUE: tl.constexpr, BLOCK: tl.constexpr,
                   NORM_NEXT: tl.constexpr, PDL: tl.constexpr):
    """The library's product y [M, ROWS] (x's dtype) into out [M, N] by `gemv`'s epilogue (`store_epilogue`; for
    SILU_MUL y holds the gate's N rows, then the up's). Program (i, m): token m's columns i BLOCK to (i + 1) BLOCK.
    NORM_NEXT (ADD, one program a token, BLOCK >= N): also the next product's input, the new residual row
    RMS-normalised and times the norm's weight nw, rounded once, into normed [M, N]: `library_input`'s work for that
    product, done here where the row already sits in registers (one launch a product fewer)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    if NORM_NEXT:
        w = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    y = tl.load(y_ptr + m * ROWS + cols, mask=ok, other=0.0).to(tl.float32)
    up = y
    if EPILOGUE == 1:
        up = tl.load(y_ptr + m * ROWS + N + cols, mask=ok, other=0.0).to(tl.float32)
    h = store_epilogue(out_ptr + m * N + cols, ok, y, up, y_ptr, EPILOGUE)
    if NORM_NEXT:
        tl.store(normed_ptr + m * N + cols, rms_normed(h, w, N, eps).to(normed_ptr.dtype.element_ty), mask=ok)
