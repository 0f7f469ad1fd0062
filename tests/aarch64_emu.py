"""The aarch64 emulation check's machinery: kernel test vectors, their file format (that of
cpu_kernels/csrc/test_driver.c), the same calls on this machine's x86 build, the
cross-build of the driver, and the bitwise comparison with its NaN rules.

Test vectors: every Adam mode (grad fp32/bf16/fp16; the four exp_avg/exp_avg_sq dtype pairs;
fp32 master or bf16 param + remainder; amsgrad; AdamW / Adam's L2; in place / bank; no, bf16
or fp16 param copy) at ragged lengths and misaligned buffers, with NaNs (quiet, signalling,
negative, with payloads), +-inf, subnormals and zeros sprinkled in; rounding ties of bf16
and fp16 (a step with lr = 0 and beta1 = 0 passes them through to the copy and exp_avg);
lengths past the thread split; grad_stats, the fp64 inverse, remainder encode/decode and
the aio engine's write/read with CRC32C; and the q8 step (issue 38: each moment format pair with
a q8 one, grads fp32/bf16/fp16, remainders, amsgrad, Adam L2 / AdamW, in place / bank, ragged
lengths and one past the thread split, blocks of zeros, of subnormals, with NaN / inf, and
absmaxes that are zero, subnormal, huge, inf or NaN), whose x86 results are also held to
cpu_kernels.q8_reference.

What must agree (the issue's rules): every non-NaN output bit for bit; an fp32 or fp16 NaN
only as a NaN (payloads and signs are not portable: inf/inf is 0xFFC00000 on x86 and
0x7FC00000 on Arm, and fma's NaN-operand priority differs); a bf16 NaN as 0x7FC0 exactly
(the kernels' own rounding); a remainder-encoded master through its decoded value (its
bits are the master's, a NaN's included); inputs bank mode must not touch, exactly. q8 codes
bit for bit, except in a block whose absmax is a NaN or an inf on both sides: there x / absmax
is a NaN (a NaN in the block, or inf / inf), whose code is the map's end (0 or 255) of its sign,
and a NaN's sign is not portable (inf / inf as above), so there either end matches either end.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import struct
import subprocess

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(REPO, "cpu_kernels", "csrc", "test_driver.c")
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"

F32, BF16, F16, I16, U8, Q8 = "f32", "bf16", "f16", "i16", "u8", "q8"
DT_CODE = {F32: 0, BF16: 1, F16: 2, Q8: 3}
SIZE = {F32: 4, BF16: 2, F16: 2, I16: 2, U8: 1, Q8: 1}  # a q8 moment's buffer holds its codes
K_ADAM, K_GRAD_STATS, K_INVERSE, K_ENCODE, K_DECODE, K_AIO, K_Q8 = range(7)
SLOTS = (
    "param",
    "grad",
    "exp_avg",
    "exp_avg_sq",
    "max",
    "param_out",
    "exp_avg_out",
    "exp_avg_sq_out",
    "max_out",
    "copy",
    "rem",
    "rem_out",
    "exp_avg_absmax",
    "exp_avg_sq_absmax",
    "max_absmax",
    "exp_avg_absmax_out",
    "exp_avg_sq_absmax_out",
    "max_absmax_out",
)
PARAMS = struct.Struct("<18i6i2q6d")  # test_driver.c's case_params_t
Q8_FIELDS = (  # q8_args_t's pointers (cpu_kernels/_q8_lib.Q8AdamArgs) and the slots they take
    ("param", "param"),
    ("grad", "grad"),
    ("exp_avg", "exp_avg"),
    ("exp_avg_absmax", "exp_avg_absmax"),
    ("exp_avg_sq", "exp_avg_sq"),
    ("exp_avg_sq_absmax", "exp_avg_sq_absmax"),
    ("max_exp_avg_sq", "max"),
    ("max_exp_avg_sq_absmax", "max_absmax"),
    ("param_out", "param_out"),
    ("exp_avg_out", "exp_avg_out"),
    ("exp_avg_absmax_out", "exp_avg_absmax_out"),
    ("exp_avg_sq_out", "exp_avg_sq_out"),
    ("exp_avg_sq_absmax_out", "exp_avg_sq_absmax_out"),
    ("max_exp_avg_sq_out", "max_out"),
    ("max_exp_avg_sq_absmax_out", "max_absmax_out"),
    ("param_copy", "copy"),
    ("remainder", "rem"),
    ("remainder_out", "rem_out"),
)

LENGTHS = (1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257, 511, 1000, 4099)
BIG = 70001  # past dispatch.c's PARALLEL_MIN (65536): several threads, 16384-element chunks
HYPERS = (
    dict(step=7, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=0.7 / 1024),
    dict(step=1, lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0, grad_scale=-1 / 512),
    dict(step=1000, lr=1e-2, beta1=0.5, beta2=0.9999, eps=1e-12, weight_decay=0.1, grad_scale=1 / 64),
)

NAN32 = (0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFC00001, 0x7F800001, 0x7FFFFFFF)
SPECIAL32 = NAN32 + (
    0x7F800000,
    0xFF800000,
    0x00000001,
    0x807FFFFF,
    0x00400000,
    0x00000000,
    0x80000000,
    0x7F7FFFFF,
    0x00800000,
)
SPECIAL_BF16 = (0x7FC0, 0xFFC0, 0x7FC1, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x0000, 0x8000, 0x7F7F)
SPECIAL_F16 = (0x7E00, 0xFE01, 0x7C01, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x0000, 0x8000, 0x7BFF)


@dataclasses.dataclass
class Buf:
    data: bytes
    dtype: str  # how its elements read: f32, bf16, f16, i16, u8
    written: bool  # an output of the call (in place or bank); else must stay as it was
    misalign: int = 0  # bytes past a 64-byte boundary


@dataclasses.dataclass
class Case:
    name: str
    kind: int
    bufs: list
    slots: dict  # slot name -> index into bufs
    n: int
    grad_dtype: str = F32
    moment_dtype: str = F32
    exp_avg_sq_dtype: str = F32
    copy_dtype: str = BF16
    decoupled: bool = True
    hyper: dict = dataclasses.field(default_factory=lambda: dict(HYPERS[0]))
    rem_pairs: tuple = ()  # (param index, remainder index) of written encoded masters
    q8_pairs: tuple = ()  # (codes index, absmax index) of written q8 moments

    def params(self) -> bytes:
        idx = [self.slots.get(s, -1) for s in SLOTS]
        h = self.hyper
        return PARAMS.pack(
            *idx,
            DT_CODE[self.grad_dtype],
            DT_CODE[self.moment_dtype],
            DT_CODE[self.exp_avg_sq_dtype],
            DT_CODE[self.copy_dtype],
            int(self.decoupled),
            0,
            self.n,
            h["step"],
            h["lr"],
            h["beta1"],
            h["beta2"],
            h["eps"],
            h["weight_decay"],
            h["grad_scale"],
        )


# ------------------------------------------------------------------------------ values
def bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def _sprinkle(bits: np.ndarray, pool, rng, share=0.06):
    k = rng.random(bits.size) < share
    bits[k] = rng.choice(np.array(pool, dtype=bits.dtype), size=int(k.sum()))
    return bits


def stream(rng, n, dtype, scale=1.0, positive=False, specials=True) -> bytes:
    x = rng.standard_normal(n).astype(np.float32) * np.float32(scale)
    if positive:
        x = np.abs(x)
    if dtype == F32:
        b = x.view(np.uint32).copy()
        return (_sprinkle(b, SPECIAL32, rng) if specials else b).tobytes()
    if dtype == BF16:
        b = bf16_bits(x)
        return (_sprinkle(b, SPECIAL_BF16, rng) if specials else b).tobytes()
    b = np.clip(x, -60000, 60000).astype(np.float16).view(np.uint16).copy()
    return (_sprinkle(b, SPECIAL_F16, rng) if specials else b).tobytes()


def encode_remainders(master_bits: np.ndarray):
    u = master_bits.astype(np.uint64)
    hi = (((u >> 16) + ((u >> 15) & 1)) & 0xFFFF).astype(np.uint16)
    return hi.tobytes(), (u & 0xFFFF).astype(np.uint16).tobytes()


def decode_remainders(p: bytes, r: bytes) -> np.ndarray:
    pp = np.frombuffer(p, np.uint16).astype(np.uint32)
    rr = np.frombuffer(r, np.uint16).astype(np.uint32)
    return ((((pp - (rr >> 15)) & 0xFFFF) << 16) | rr).astype(np.uint32).view(np.float32)


def tie_values(rng, n) -> np.ndarray:
    """fp32 bits on rounding ties of bf16 (low half 0x8000) and fp16 (normal and subnormal
    halves, the overflow edge), beside specials."""
    hi = rng.integers(0, 0x7F80, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 15)
    bf16_ties = (hi << 16) | 0x8000
    exp = rng.integers(103, 143, n, dtype=np.uint32)  # fp16's subnormal to top binades
    f16_ties = (
        (rng.integers(0, 2, n, dtype=np.uint32) << 31)
        | (exp << 23)
        | (rng.integers(0, 1024, n, dtype=np.uint32) << 13)
        | 0x1000
    )
    edge = np.array(
        [
            65520.0,
            65519.996,
            -65520.0,
            65504.0,
            2.0**-25,
            3 * 2.0**-25,
            2.0**-24,
            5.960464477539063e-08,
            3.3961776e38,
            3.3895314e38,
        ],
        np.float32,
    ).view(np.uint32)
    out = np.where(rng.random(n) < 0.5, bf16_ties, f16_ties).astype(np.uint32)
    out[: min(n, edge.size)] = edge[: min(n, edge.size)]
    return _sprinkle(out, SPECIAL32, rng, share=0.04)


# ------------------------------------------------------------------------------- cases
def step_name(kind, n, gdt, mdt, vdt, rem, ams, decoupled, bank, copy) -> str:
    """An Adam or q8 step case's name: its length and every mode, in words the tests look for."""
    return (
        f"{kind} n={n} grad={gdt} m={mdt} v={vdt} {'remainders' if rem else 'fp32_master'} "
        f"{'amsgrad' if ams else 'adam'} {'adamw' if decoupled else 'l2'} "
        f"{'bank' if bank else 'in_place'} copy={copy}"
    )


def adam_case(rng, idx, n, gdt, mdt, vdt, rem, ams, decoupled, bank, copy, hyper, ties=False):
    bufs, slots, pairs = [], {}, []

    def add(slot, data, dtype, written, mis=0):
        slots[slot] = len(bufs)
        bufs.append(Buf(data, dtype, written, mis))
        return slots[slot]

    mis = idx % 4  # some calls with every buffer aligned, others at odd element offsets
    if ties:
        master = tie_values(rng, n)
        grad = tie_values(rng, n).view(np.uint32).tobytes()
        m0 = np.zeros(n, np.float32).tobytes() if mdt == F32 else np.zeros(n, np.uint16).tobytes()
    else:
        master = np.frombuffer(stream(rng, n, F32), np.uint32).copy()
        grad = stream(rng, n, gdt, scale=64.0)
        m0 = stream(rng, n, mdt, scale=0.1)
    v0 = stream(rng, n, vdt, scale=1e-2, positive=True)
    if rem:
        p16, r16 = encode_remainders(master)
        ip = add("param", p16, BF16, not bank, mis * 2)
        ir = add("rem", r16, I16, not bank, mis * 2)
    else:
        add("param", master.tobytes(), F32, not bank, mis * 4)
    add("grad", grad, gdt, False, (mis * SIZE[gdt]) % 64)
    add("exp_avg", m0, mdt, not bank, 0)
    add("exp_avg_sq", v0, vdt, not bank, mis * SIZE[vdt])
    if ams:
        x = np.frombuffer(v0, np.uint32 if vdt == F32 else np.uint16).copy()
        # about half above v (the max keeps it), NaN, inf and zeros among them
        x = np.where(rng.random(n) < 0.5, x, np.frombuffer(stream(rng, n, vdt, 2e-2, positive=True), x.dtype))
        add("max", x.tobytes(), vdt, not bank, 0)
    if bank:
        omis = (idx // 4) % 3  # out views 0, 1 or 2 elements past a line
        poison = {4: b"\x01\x00\xc0\x7f", 2: b"\xff\x7f"}
        psz = 2 if rem else 4
        ip = add("param_out", poison[psz] * n, BF16 if rem else F32, True, omis * psz)
        add("exp_avg_out", poison[SIZE[mdt]] * n, mdt, True, omis * SIZE[mdt])
        add("exp_avg_sq_out", poison[SIZE[vdt]] * n, vdt, True, omis * SIZE[vdt])
        if ams:
            add("max_out", poison[SIZE[vdt]] * n, vdt, True, 0)
        if rem:
            ir = add("rem_out", poison[2] * n, I16, True, omis * 2)
    else:
        slots["param_out"], slots["exp_avg_out"], slots["exp_avg_sq_out"] = (
            slots["param"],
            slots["exp_avg"],
            slots["exp_avg_sq"],
        )
        if ams:
            slots["max_out"] = slots["max"]
        if rem:
            slots["rem_out"] = slots["rem"]
    if rem:
        pairs.append((ip, ir))
    if copy:
        add("copy", b"\xff\x7f" * n, copy, True, (idx % 3) * 2)
    name = step_name("adam", n, gdt, mdt, vdt, rem, ams, decoupled, bank, copy) + (" ties" if ties else "")
    return Case(
        name, K_ADAM, bufs, slots, n, gdt, mdt, vdt, copy or BF16, decoupled, dict(hyper), tuple(pairs)
    )


Q8_LENGTHS = (1, 17, 255, 256, 257, 300, 511, 512, 777, 1000, 1279, 4099)
Q8_FORMATS = ((Q8, Q8), (Q8, F32), (Q8, BF16), (F32, Q8), (BF16, Q8))  # (exp_avg, exp_avg_sq)
# absmaxes a block may carry in: zero, subnormal (a large one and the smallest), huge, inf, NaNs
ABSMAX_SPECIAL = (0x00000000, 0x000AE398, 0x00000001, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001)
BLOCK_KINDS = ("plain", "zero", "tiny", "nonfinite", "absmax")


def q8_case(rng, idx, n, gdt, mdt, vdt, rem, ams, decoupled, bank, copy, hyper):
    """A q8 step's buffers; each block of 256 is of one kind: plain (finite), zero (param, grad and
    moments 0: a zero block out), tiny (subnormal grads, params and absmaxes: subnormal absmaxes
    out), nonfinite (NaN / inf grads) or absmax (a q8 moment's absmax from ABSMAX_SPECIAL)."""
    bufs, slots, q8_pairs = [], {}, []

    def add(slot, data, dtype, written, mis=0):
        slots[slot] = len(bufs)
        bufs.append(Buf(data, dtype, written, mis))
        return slots[slot]

    blocks = -(-n // 256)
    kinds = rng.choice(len(BLOCK_KINDS), size=blocks, p=(0.6, 0.1, 0.1, 0.1, 0.1))
    kind = np.repeat(kinds, 256)[:n]
    zero, tiny, nonfinite = (kind == BLOCK_KINDS.index(k) for k in ("zero", "tiny", "nonfinite"))
    master = rng.standard_normal(n).astype(np.float32)
    master[zero], master[tiny] = 0.0, master[tiny] * np.float32(1e-38)
    g = rng.standard_normal(n).astype(np.float32) * np.float32(64.0)
    g[zero], g[tiny] = 0.0, g[tiny] * np.float32(1e-40)
    if gdt == F32:
        gbits = g.view(np.uint32).copy()
        gbits[nonfinite] = _sprinkle(gbits[nonfinite], SPECIAL32, rng)
    elif gdt == BF16:
        gbits = bf16_bits(g)
        gbits[nonfinite] = _sprinkle(gbits[nonfinite], SPECIAL_BF16, rng)
    else:
        gbits = np.clip(g, -60000, 60000).astype(np.float16).view(np.uint16).copy()
        gbits[nonfinite] = _sprinkle(gbits[nonfinite], SPECIAL_F16, rng)

    def moment(fmt, signed, scale):
        """(the moment's bytes, its absmax's bytes or None)"""
        if fmt == Q8:
            absmax = (rng.lognormal(0.0, 1.0, blocks) * scale).astype(np.float32).view(np.uint32)
            absmax[kinds == BLOCK_KINDS.index("zero")] = 0
            small = kinds == BLOCK_KINDS.index("tiny")
            absmax[small] = rng.integers(1, 0x800000, int(small.sum()), dtype=np.uint32)
            odd = kinds == BLOCK_KINDS.index("absmax")
            absmax[odd] = rng.choice(np.array(ABSMAX_SPECIAL, np.uint32), size=int(odd.sum()))
            return rng.integers(0, 256, n, dtype=np.uint8).tobytes(), absmax.tobytes()
        x = rng.standard_normal(n).astype(np.float32) * np.float32(scale)
        x = x if signed else np.abs(x)
        x[zero], x[tiny] = 0.0, x[tiny] * np.float32(1e-38)
        if fmt == F32:
            return x.tobytes(), None
        return bf16_bits(x).tobytes(), None

    mis = idx % 4
    if rem:
        p16, r16 = encode_remainders(master.view(np.uint32))
        ip = add("param", p16, BF16, not bank, mis * 2)
        ir = add("rem", r16, I16, not bank, mis * 2)
    else:
        add("param", master.tobytes(), F32, not bank, mis * 4)
    add("grad", gbits.tobytes(), gdt, False, (mis * SIZE[gdt]) % 64)
    moments = [("exp_avg", mdt, True, 0.1), ("exp_avg_sq", vdt, False, 1e-2)]
    if ams:
        moments.append(("max", vdt, False, 2e-2))
    poison = {4: b"\x01\x00\xc0\x7f", 2: b"\xff\x7f", 1: b"\x55"}
    for name, fmt, signed, scale in moments:
        data, absmax = moment(fmt, signed, scale)
        ic = add(name, data, fmt, not bank, mis * SIZE[fmt])
        ia = add(f"{name}_absmax", absmax, F32, not bank, 4 * (mis % 2)) if absmax else None
        if bank:
            omis = (idx // 4) % 3  # out views 0, 1 or 2 elements past a line
            ic = add(f"{name}_out", poison[SIZE[fmt]] * n, fmt, True, omis * SIZE[fmt])
            if absmax:
                ia = add(f"{name}_absmax_out", poison[4] * (len(absmax) // 4), F32, True, 4 * omis)
        else:
            slots[f"{name}_out"] = ic
            if absmax:
                slots[f"{name}_absmax_out"] = ia
        if fmt == Q8:
            q8_pairs.append((ic, ia))
    if bank:
        ip = add("param_out", poison[2 if rem else 4] * n, BF16 if rem else F32, True, 0)
        if rem:
            ir = add("rem_out", poison[2] * n, I16, True, 2)
    else:
        slots["param_out"] = slots["param"]
        if rem:
            slots["rem_out"] = slots["rem"]
    if copy:
        add("copy", b"\xff\x7f" * n, copy, True, (idx % 3) * 2)
    name = step_name("q8", n, gdt, mdt, vdt, rem, ams, decoupled, bank, copy)
    rem_pairs = ((ip, ir),) if rem else ()
    return Case(
        name,
        K_Q8,
        bufs,
        slots,
        n,
        gdt,
        mdt,
        vdt,
        copy or BF16,
        decoupled,
        dict(hyper),
        rem_pairs,
        tuple(q8_pairs),
    )


def q8_boundary_case(rng, signed):
    """Values on and beside every code boundary of one map, both moments q8 and in place: with
    beta1 = 0 the new exp_avg is the grad, with beta2 = 0 the new exp_avg_sq is grad·grad, and each
    block's first grad is 1.0 (its absmax), so the signed map sees the fp32 values nearest each
    midpoint between its codes, 2 ulps either side, and the unsigned map the squares of those
    around each of its midpoints' square roots."""
    from cpu_kernels import q8_reference as q8

    qmap = q8.dynamic_map(signed).double().numpy()
    mids = (qmap[:-1] + qmap[1:]) / 2
    centre = (mids if signed else np.sqrt(mids)).astype(np.float32).view(np.uint32)
    near = (centre[:, None].astype(np.int64) + np.arange(-2, 3)).astype(np.uint32).ravel().view(np.float32)
    rows = [np.concatenate([[np.float32(1.0)], near[k : k + 255]]) for k in range(0, near.size, 255)]
    g = np.concatenate(rows).astype(np.float32)
    n, blocks = g.size, -(-g.size // 256)
    bufs = [
        Buf(rng.standard_normal(n).astype(np.float32).tobytes(), F32, True),
        Buf(g.tobytes(), F32, False),
        Buf(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), Q8, True, 3),
        Buf(np.zeros(blocks, np.float32).tobytes(), F32, True),  # m = map[code] · 0
        Buf(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), Q8, True, 1),
        Buf(np.zeros(blocks, np.float32).tobytes(), F32, True),
    ]
    slots = dict(param=0, grad=1, exp_avg=2, exp_avg_absmax=3, exp_avg_sq=4, exp_avg_sq_absmax=5)
    slots.update(param_out=0, exp_avg_out=2, exp_avg_absmax_out=3, exp_avg_sq_out=4, exp_avg_sq_absmax_out=5)
    hyper = dict(step=3, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, grad_scale=1.0)
    name = f"q8 n={n} boundaries of the {'signed' if signed else 'unsigned'} map"
    return Case(name, K_Q8, bufs, slots, n, F32, Q8, Q8, BF16, True, hyper, (), ((2, 3), (4, 5)))


def q8_cases(rng) -> list:
    """Every q8 moment format pair x grad dtype x (amsgrad, bank), remainders / L2 / copies and
    the hyperparameters rotating; two past the thread split (BIG); each map's code boundaries."""
    cases, idx = [], 0
    for mdt, vdt in Q8_FORMATS:
        for gdt in (F32, BF16, F16):
            for ams, bank in ((False, False), (True, True), (False, True), (True, False)):
                rem = idx % 3 == 1
                copy = None if rem else (None, BF16, F16)[(idx // 3) % 3]
                n = Q8_LENGTHS[(idx * 5) % len(Q8_LENGTHS)]
                cases.append(
                    q8_case(rng, idx, n, gdt, mdt, vdt, rem, ams, idx % 2 == 0, bank, copy, HYPERS[idx % 3])
                )
                idx += 1
    cases.append(q8_case(rng, 1, BIG, F32, Q8, Q8, False, True, True, True, BF16, HYPERS[0]))
    cases.append(q8_case(rng, 2, BIG + 1, BF16, Q8, BF16, True, False, False, False, None, HYPERS[2]))
    return cases + [q8_boundary_case(rng, signed) for signed in (True, False)]


def kernel_cases(seed=23) -> list:
    """The test vectors (deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    cases, idx = [], 0
    pairs = ((F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32))
    for gdt in (F32, BF16, F16):
        for mdt, vdt in pairs:
            for rem in (False, True):
                for ams in (False, True):
                    for decoupled in (True, False):
                        for bank in (False, True):
                            for copy in (None,) if rem else (None, BF16, F16):
                                for shift in (0, 11):  # two lengths each, one short one not
                                    n = LENGTHS[(idx * 7 + shift) % len(LENGTHS)]
                                    cases.append(
                                        adam_case(
                                            rng,
                                            idx,
                                            n,
                                            gdt,
                                            mdt,
                                            vdt,
                                            rem,
                                            ams,
                                            decoupled,
                                            bank,
                                            copy,
                                            HYPERS[(idx + shift) % len(HYPERS)],
                                        )
                                    )
                                idx += 1
    ties = dict(step=3, lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=1.0)
    for k, (mdt, copy, rem, bank) in enumerate(
        (
            (F32, BF16, False, False),
            (BF16, F16, False, True),
            (BF16, BF16, False, True),
            (F32, F16, False, False),
            (BF16, None, True, False),
            (BF16, None, True, True),
        )
    ):
        cases.append(
            adam_case(rng, k, 4099 - k, F32, mdt, BF16, rem, k % 2 == 1, True, bank, copy, ties, ties=True)
        )
    for k, spec in enumerate(
        (
            (F32, F32, F32, False, False, True, None),
            (BF16, BF16, BF16, True, True, False, None),
            (F16, F32, BF16, False, True, True, F16),
        )
    ):
        gdt, mdt, vdt, rem, ams, bank, copy = spec
        cases.append(adam_case(rng, k, BIG + k, gdt, mdt, vdt, rem, ams, k != 1, bank, copy, HYPERS[k]))
    for gdt in (F32, BF16, F16):
        for n in (1, 15, 16, 17, 100, 16384, 16385, 3 * 16384 + 77):
            specials = n == 100  # one case with NaN/inf (the sum is then NaN or inf); the rest finite
            data = stream(rng, n, gdt, scale=1e3, specials=specials)
            if not specials and gdt == F32 and n > 16:  # subnormals and huge squares, all finite
                b = np.frombuffer(data, np.uint32).copy()
                b[::5] = 0x00000003
                b[1::7] = 0x7F000000
                data = b.tobytes()
            cases.append(
                Case(
                    f"grad_stats n={n} {gdt}",
                    K_GRAD_STATS,
                    [Buf(data, gdt, False)],
                    {"grad": 0},
                    n,
                    grad_dtype=gdt,
                )
            )
    for gdt in (F32, BF16, F16):
        for decoupled in (True, False):
            for n in (5, 33, 1000):
                bufs = [
                    Buf(stream(rng, n, F32), F32, True),
                    Buf(stream(rng, n, gdt, 64.0), gdt, False),
                    Buf(stream(rng, n, F32, 0.1), F32, True),
                    Buf(stream(rng, n, F32, 1e-2, positive=True), F32, True),
                ]
                cases.append(
                    Case(
                        f"inverse n={n} grad={gdt} {'adamw' if decoupled else 'l2'}",
                        K_INVERSE,
                        bufs,
                        dict(param=0, grad=1, exp_avg=2, exp_avg_sq=3),
                        n,
                        grad_dtype=gdt,
                        decoupled=decoupled,
                        hyper=dict(HYPERS[0]),
                    )
                )
    for n in (1, 9, 17, 4099):
        m = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        m[: min(n, 6)] = np.array(
            [0x7F7F8000, 0x7FFF8000, 0xFFFF8000, 0x7F800001, 0x3F808000, 0x3F818000], np.uint32
        )[: min(n, 6)]
        cases.append(
            Case(
                f"encode n={n}",
                K_ENCODE,
                [Buf(m.tobytes(), U8, False), Buf(b"\0\0" * n, U8, True), Buf(b"\0\0" * n, U8, True, 2)],
                dict(param=0, param_out=1, rem_out=2),
                n,
            )
        )
        p16, r16 = encode_remainders(m)
        cases.append(
            Case(
                f"decode n={n}",
                K_DECODE,
                [Buf(p16, U8, False), Buf(r16, U8, False, 2), Buf(b"\0\0\0\0" * n, U8, True)],
                dict(param=0, rem=1, param_out=2),
                n,
            )
        )
    data = rng.integers(0, 256, 50000, dtype=np.uint8).tobytes()
    cases.append(
        Case(
            "aio write/read with CRC32C",
            K_AIO,
            [Buf(data, U8, False), Buf(b"\0" * len(data), U8, True)],
            dict(param=0, param_out=1),
            len(data),
        )
    )
    return cases + q8_cases(rng)


# --------------------------------------------------------------------------- file format
def write_cases(path, cases):
    with open(path, "wb") as f:
        f.write(b"HOKCASE1" + struct.pack("<II", len(cases), 0))
        for c in cases:
            f.write(struct.pack("<II", c.kind, len(c.bufs)))
            for b in c.bufs:
                f.write(struct.pack("<QII", len(b.data), b.misalign, 0))
            for b in c.bufs:
                f.write(b.data)
            f.write(c.params())


def read_outputs(path, cases):
    """[(buffers after the call, scalar, status)] in case order."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:8] != b"HOKOUT01":
        raise ValueError(f"{path}: not a test_driver output file")
    (count, _), pos, out = struct.unpack_from("<II", raw, 8), 16, []
    if count != len(cases):
        raise ValueError(f"{path}: {count} cases, expected {len(cases)}")
    for c in cases:
        (nbuf,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        bufs = []
        for b in c.bufs[:nbuf]:
            bufs.append(raw[pos : pos + len(b.data)])
            pos += len(b.data)
        scalar, status, _ = struct.unpack_from("<dii", raw, pos)
        pos += 16
        out.append((bufs, scalar, status))
    return out


# ------------------------------------------------------------------ the same calls on x86
def _aligned(nbytes, misalign):
    raw = np.zeros(nbytes + 128, np.uint8)
    off = (-raw.ctypes.data) % 64 + misalign
    return raw, off


def run_here(cases, level):
    """Every case through this machine's cpu_kernels library (the installed build) at
    `level`, in the driver's output layout."""
    import cpu_kernels
    from cpu_kernels import _lib, _q8_lib

    lib = _lib.lib
    lib.hybrid_crc32c.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int64]
    lib.hybrid_crc32c.restype = ctypes.c_uint32
    saved = cpu_kernels.simd_level()
    cpu_kernels.set_simd_level(level)
    try:
        results = []
        for c in cases:
            mem = [_aligned(len(b.data), b.misalign) for b in c.bufs]
            for (raw, off), b in zip(mem, c.bufs):
                raw[off : off + len(b.data)] = np.frombuffer(b.data, np.uint8)
            ptr = {s: mem[i][0].ctypes.data + mem[i][1] for s, i in c.slots.items()}
            scalar, status, h = 0.0, 0, c.hyper
            if c.kind in (K_ADAM, K_INVERSE):
                a = _lib.AdamArgs() if c.kind == K_ADAM else _lib.InverseArgs()
                a.n = c.n
                for field, s in (
                    ("param", "param"),
                    ("grad", "grad"),
                    ("exp_avg", "exp_avg"),
                    ("exp_avg_sq", "exp_avg_sq"),
                ):
                    setattr(a, field, ptr.get(s))
                a.grad_dtype, a.decoupled, a.step = DT_CODE[c.grad_dtype], int(c.decoupled), h["step"]
                a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale = (
                    h["lr"],
                    h["beta1"],
                    h["beta2"],
                    h["eps"],
                    h["weight_decay"],
                    h["grad_scale"],
                )
                if c.kind == K_ADAM:
                    for field, s in (
                        ("max_exp_avg_sq", "max"),
                        ("param_out", "param_out"),
                        ("exp_avg_out", "exp_avg_out"),
                        ("exp_avg_sq_out", "exp_avg_sq_out"),
                        ("max_exp_avg_sq_out", "max_out"),
                        ("param_copy", "copy"),
                        ("remainder", "rem"),
                        ("remainder_out", "rem_out"),
                    ):
                        setattr(a, field, ptr.get(s))
                    a.moment_dtype, a.exp_avg_sq_dtype = DT_CODE[c.moment_dtype], DT_CODE[c.exp_avg_sq_dtype]
                    a.copy_dtype = DT_CODE[c.copy_dtype]
                    lib.hybrid_adam_step(ctypes.byref(a))
                else:
                    lib.hybrid_adam_inverse(ctypes.byref(a))
            elif c.kind == K_GRAD_STATS:
                out = ctypes.c_double()
                assert lib.hybrid_grad_stats(ptr["grad"], DT_CODE[c.grad_dtype], c.n, ctypes.byref(out)) == 0
                scalar = out.value
            elif c.kind == K_ENCODE:
                lib.hybrid_remainder_encode(ptr["param"], ptr["param_out"], ptr["rem_out"], c.n)
            elif c.kind == K_DECODE:
                lib.hybrid_remainder_decode(ptr["param"], ptr["rem"], ptr["param_out"], c.n)
            elif c.kind == K_AIO:
                mem[1][0][mem[1][1] : mem[1][1] + c.n] = mem[0][0][mem[0][1] : mem[0][1] + c.n]
                scalar = float(lib.hybrid_crc32c(0, ptr["param"], c.n))
            elif c.kind == K_Q8:
                q = _q8_lib.Q8AdamArgs(**{field: ptr.get(s) for field, s in Q8_FIELDS})
                q.n, q.grad_dtype, q.decoupled, q.step = (
                    c.n,
                    DT_CODE[c.grad_dtype],
                    int(c.decoupled),
                    h["step"],
                )
                q.exp_avg_dtype, q.exp_avg_sq_dtype = DT_CODE[c.moment_dtype], DT_CODE[c.exp_avg_sq_dtype]
                q.copy_dtype = DT_CODE[c.copy_dtype]
                for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale"):
                    setattr(q, k, h[k])
                status = 40 if lib.hybrid_q8_adam_step(ctypes.byref(q)) else 0  # as the driver says it
            results.append(
                (
                    [raw[off : off + len(b.data)].tobytes() for (raw, off), b in zip(mem, c.bufs)],
                    scalar,
                    status,
                )
            )
        return results
    finally:
        cpu_kernels.set_simd_level(saved)


def run_reference(cases):
    """The q8 cases through cpu_kernels.q8_reference (pure torch; the copy as torch casts), in the
    driver's output layout; None for every other case."""
    import torch

    from cpu_kernels import q8_reference as q8
    from cpu_kernels.reference import bf16_round_reference

    dtypes = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16, Q8: torch.uint8, I16: torch.int16}
    results = []
    for c in cases:
        if c.kind != K_Q8:
            results.append(None)
            continue
        data = [bytearray(b.data) for b in c.bufs]

        def tensor(slot, dtype):
            return torch.frombuffer(bytearray(c.bufs[c.slots[slot]].data), dtype=dtypes[dtype])

        def moment(name, fmt):
            if name not in c.slots:
                return None
            if fmt == Q8:
                return q8.Q8Blocks(tensor(name, Q8), tensor(f"{name}_absmax", F32))
            return tensor(name, fmt)

        def put(slot, t):
            data[c.slots[slot]][:] = t.contiguous().view(torch.uint8).numpy().tobytes()

        rem = tensor("rem", I16) if "rem" in c.slots else None
        p, m, v, x, r = q8.q8_adam_step_reference(
            tensor("param", F32 if rem is None else BF16),
            tensor("grad", c.grad_dtype),
            moment("exp_avg", c.moment_dtype),
            moment("exp_avg_sq", c.exp_avg_sq_dtype),
            max_exp_avg_sq=moment("max", c.exp_avg_sq_dtype),
            remainder=rem,
            decoupled=c.decoupled,
            **c.hyper,
        )
        put("param_out", p)
        if r is not None:
            put("rem_out", r)
        for name, new in (("exp_avg", m), ("exp_avg_sq", v), ("max", x)):
            if isinstance(new, q8.Q8Blocks):
                put(f"{name}_out", new.codes)
                put(f"{name}_absmax_out", new.absmax)
            elif new is not None:
                put(f"{name}_out", new)
        if "copy" in c.slots:
            put("copy", bf16_round_reference(p) if c.copy_dtype == BF16 else p.to(torch.float16))
        results.append(([bytes(d) for d in data], 0.0, 0))
    return results


# ------------------------------------------------------------------------- comparison
def _elements(data, dtype):
    return np.frombuffer(data, {4: np.uint32, 2: np.uint16, 1: np.uint8}[SIZE[dtype]])


def _is_nan(u, dtype):
    if dtype == F32:
        return (u & 0x7FFFFFFF) > 0x7F800000
    if dtype == BF16:
        return (u & 0x7FFF) > 0x7F80
    if dtype == F16:
        return (u & 0x7FFF) > 0x7C00
    return np.zeros(u.shape, bool)


def compare(case, want, got, what):
    """Mismatches (strings) of `got` (the Arm run) against `want` (x86) for one case."""
    (wb, ws, _), (gb, gs, gstat) = want, got
    bad = []
    if gstat != 0:
        bad.append(f"{what}: {case.name}: the driver's own checks failed (status {gstat})")
    paired = {i for pair in case.rem_pairs for i in pair} | {ic for ic, _ in case.q8_pairs}
    for ip, ir in case.rem_pairs:
        x, y = decode_remainders(wb[ip], wb[ir]), decode_remainders(gb[ip], gb[ir])
        xu, yu = x.view(np.uint32), y.view(np.uint32)
        diff = (xu != yu) & ~(np.isnan(x) & np.isnan(y))
        if diff.any():
            k = np.flatnonzero(diff)[:4]
            bad.append(
                f"{what}: {case.name}: decoded master differs at {k.tolist()}: "
                f"{[hex(v) for v in xu[k]]} vs {[hex(v) for v in yu[k]]}"
            )
    for ic, ia in case.q8_pairs:
        u, v = _elements(wb[ic], Q8), _elements(gb[ic], Q8)
        wa, ga = np.frombuffer(wb[ia], np.float32), np.frombuffer(gb[ia], np.float32)
        nan_block = ~np.isfinite(wa) & ~np.isfinite(ga)  # absmax >= 0: a NaN or +inf
        ends = np.isin(u, (0, 255)) & np.isin(v, (0, 255)) & np.repeat(nan_block, 256)[: u.size]
        diff = (u != v) & ~ends
        if diff.any():
            k = np.flatnonzero(diff)[:4]
            bad.append(
                f"{what}: {case.name}: q8 codes (buffer {ic}) differ in {int(diff.sum())} elements, first at "
                f"{k.tolist()}: {u[k].tolist()} vs {v[k].tolist()}"
            )
    for i, b in enumerate(case.bufs):
        if i in paired:
            continue
        u, v = _elements(wb[i], b.dtype), _elements(gb[i], b.dtype)
        if not b.written:
            diff = u != v
        else:
            diff = (u != v) & ~(_is_nan(u, b.dtype) & _is_nan(v, b.dtype) & (b.dtype != BF16))
            if b.dtype == BF16 and (_is_nan(v, BF16) & (v != 0x7FC0)).any():
                bad.append(f"{what}: {case.name}: buffer {i} holds a bf16 NaN other than 0x7FC0")
        if diff.any():
            k = np.flatnonzero(diff)[:4]
            bad.append(
                f"{what}: {case.name}: buffer {i} ({b.dtype}, {'written' if b.written else 'input'}) "
                f"differs in {int(diff.sum())} elements, first at {k.tolist()}: "
                f"{[hex(int(t)) for t in u[k]]} vs {[hex(int(t)) for t in v[k]]}"
            )
    if struct.pack("<d", ws) != struct.pack("<d", gs) and not (ws != ws and gs != gs):
        bad.append(f"{what}: {case.name}: scalar {ws!r} vs {gs!r}")
    return bad


# -------------------------------------------------------------------- build and emulate
def missing_tools():
    return [t for t in (CROSS_CC, QEMU) if shutil.which(t) is None]


def cross_build(out_path, timeout=300):
    """The driver and the library's C sources, cross-compiled with the library's own flags,
    linked statically (qemu-aarch64 then needs no aarch64 sysroot)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_build", os.path.join(REPO, "cpu_kernels", "_build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    cmd = [
        CROSS_CC,
        *build.COMPILE_ARGS,
        "-static",
        "-o",
        out_path,
        DRIVER,
        *[os.path.join(REPO, s) for s in build.LIBRARY_SOURCES],
        *build.LINK_ARGS,
        "-lm",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"cross-compiling the driver failed:\n{' '.join(cmd)}\n{proc.stderr}")
    return [
        line
        for line in proc.stderr.splitlines()
        if "warning" in line and "dlopen" not in line and "libgomp" not in line and "oacc" not in line
    ]


def emulate(driver, cpu, args, timeout=120):
    """qemu-aarch64 -cpu CPU DRIVER ARGS -> (returncode, stdout, stderr), bounded."""
    proc = subprocess.run([QEMU, "-cpu", cpu, driver, *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr
