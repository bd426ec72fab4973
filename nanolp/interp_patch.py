"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) compute bf16 like a GPU, and fp32 reductions exactly.

Stock Triton 3.8/3.9 interpreters store bf16 as raw uint16 bits and
  * cast fp32 -> bf16 by truncation instead of round-to-nearest-even,
  * feed the raw bit patterns of bf16 operands to np.matmul in tl.dot (results around 1e10),
  * run bf16 elementwise ops and sums on the bit patterns.
Without this patch a CPU test of a bf16 kernel proves nothing (self_test checks the casts and the dots).

Second, so the kernel can be compared bit for bit with nanolp/emulate.py, the operations whose float32 result
depends on an implementation's internal order or approximation (tl.dot, tl.sum, exp, exp2, log, log2) are
evaluated in float64 and rounded once to float32, exactly as the emulation does. Then the two agree bit for
bit unless their algorithms or rounding points differ.

tl.fma needs no patch: the stock interpreter computes it in C, rounded once (kernels._exp2's fused exponent;
nanolp/emulate.fma_f32 rounds it once too, by rounding to odd from float64); self_test() checks a case where
rounding to float64 first and then to float32 would be wrong.

Third, the stock interpreters have no TMA reduction (a tensor descriptor's atomic_add: "'InterpreterBuilder'
object has no attribute 'create_descriptor_reduce'"), which experiments/launch_variants.py's one-pass backward uses
with DQ_TMA; here it adds the block element by element with the interpreter's own atomics, as tl.atomic_add does.

The patch reaches into interpreter internals, so it is pinned to the versions it was checked on, and
self_test() (run by tests/conftest.py before any test) fails loudly if it stops taking effect.
"""
import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as interp

CHECKED_VERSIONS = ("3.8.", "3.9.")

_Handle = interp.TensorHandle
_Builder = interp.InterpreterBuilder
_Reduce = interp.ReduceOps
_stock_generic_reduce = _Reduce.generic_reduce


def _bf16_to_f32(bits):
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16(x):
    """fp32 -> bf16 bits, round to nearest even; NaN stays NaN (as torch.Tensor.to(torch.bfloat16))."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    with np.errstate(over="ignore"):
        r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, (b >> np.uint32(16)) | np.uint32(0x40), r).astype(np.uint16).reshape(np.shape(x))


def _as_f32(h):
    """An fp32 view of a bf16/fp16/fp32 operand (exact: both fit in fp32)."""
    if h.dtype.scalar == tl.bfloat16:
        return _bf16_to_f32(h.data)
    return h.data.astype(np.float32)


def _exact_f32(fn):
    """fn evaluated in float64 and rounded once to float32 (the emulation's primitives do the same)."""
    def op(x):
        if x.dtype != np.float32:
            return fn(x)
        with np.errstate(all="ignore"):
            return fn(x.astype(np.float64)).astype(np.float32)
    return op


_orig = dict(cast_impl=_Builder.cast_impl, create_dot=_Builder.create_dot, binary_op=_Builder.binary_op,
             unary_op=_Builder.unary_op, sum=_Reduce.sum, min_max=_Reduce.min_max,
             create_exp=_Builder.create_exp, create_exp2=_Builder.create_exp2,
             create_log=_Builder.create_log, create_log2=_Builder.create_log2)


def _cast_impl(self, src, dst_type):
    s, d = src.dtype.scalar, dst_type.scalar
    if d == tl.bfloat16 and s in (tl.float32, tl.float64, tl.float16):
        return _Handle(_f32_to_bf16(src.data.astype(np.float32)), tl.bfloat16)
    if s == tl.bfloat16 and d in (tl.float32, tl.float64, tl.float16):
        return _Handle(_bf16_to_f32(src.data).astype(interp._get_np_dtype(d)), d)
    return _orig["cast_impl"](self, src, dst_type)


def _create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
    prod = torch.matmul(torch.from_numpy(_as_f32(a)).double(), torch.from_numpy(_as_f32(b)).double()).float()
    return _Handle(prod.numpy() + acc.data, acc.dtype.scalar)


def _binary_op(self, lhs, rhs, op):
    if tl.bfloat16 in (lhs.dtype.scalar, rhs.dtype.scalar):
        out = op(_as_f32(lhs) if lhs.dtype.scalar == tl.bfloat16 else lhs.data,
                 _as_f32(rhs) if rhs.dtype.scalar == tl.bfloat16 else rhs.data)
        if out.dtype == np.bool_:
            return _Handle(out, tl.int1)
        return _Handle(_f32_to_bf16(out.astype(np.float32)), tl.bfloat16)
    return _orig["binary_op"](self, lhs, rhs, op)


def _unary_op(self, arg, op):
    if arg.dtype.scalar == tl.bfloat16:
        return _Handle(_f32_to_bf16(op(_as_f32(arg)).astype(np.float32)), tl.bfloat16)
    return _orig["unary_op"](self, arg, op)


def _sum(self, input):
    data = input.handle.data
    if input.dtype == tl.bfloat16:
        total = np.sum(_bf16_to_f32(data).astype(np.float64), axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(_f32_to_bf16(total.astype(np.float32)), tl.bfloat16)
    if data.dtype == np.float32:
        total = np.sum(data.astype(np.float64), axis=self.axis, keepdims=self.keep_dims).astype(np.float32)
        return self.to_tensor(total, input.dtype)
    return _orig["sum"](self, input)


def _min_max(self, input, val_reduce_op, idx_reduce_op=None):
    inp = input[0] if isinstance(input, tuple) else input
    if inp.dtype != tl.bfloat16:
        return _orig["min_max"](self, input, val_reduce_op, idx_reduce_op)
    ret = _orig["min_max"](self, self.to_tensor(_bf16_to_f32(inp.handle.data), tl.float32), val_reduce_op,
                           idx_reduce_op)
    back = lambda t: self.to_tensor(_f32_to_bf16(t.handle.data), tl.bfloat16) if t.dtype == tl.float32 else t
    return tuple(back(t) for t in ret) if isinstance(ret, tuple) else back(ret)


def _generic_reduce(self, input):
    """tl.reduce with a custom combine (kernels.py's top-2): the stock interpreter calls the combine once per
    element in Python; this makes the same left fold along the axis a slice at a time, the same combines in the
    same order per output element (~60x faster on a 64-wide row)."""
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    data = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
    acc = tuple(self.to_tensor(d[0].copy(), arg.dtype) for d, arg in zip(data, input))
    for j in range(1, data[0].shape[0]):
        ret = self.combine_fn.fn(*acc, *(self.to_tensor(d[j].copy(), arg.dtype) for d, arg in zip(data, input)))
        acc = ret if isinstance(ret, tuple) else (ret,)
    out = []
    for value, arg in zip(acc, input):
        value = np.asarray(value.handle.data if isinstance(value, tl.core.tensor) else value,
                           dtype=arg.handle.data.dtype).reshape(data[0].shape[1:])
        if self.keep_dims:
            value = np.expand_dims(value, axis) if original_axis is not None else value.reshape((1,) * data[0].ndim)
        elif original_axis is None:
            value = value.item()
        out.append(self.to_tensor(value, arg.dtype))
    return out


def _create_descriptor_reduce(self, kind, desc, value, indices):
    """desc.atomic_add(indices, value) in fp32: the block added at the descriptor's pointers, the elements
    outside the tensor's shape dropped (as the GPU's TMA does)."""
    if kind != interp._ir.DESCRIPTOR_REDUCE_KIND.ADD or value.dtype.scalar != tl.float32:
        raise NotImplementedError(f"interp_patch: TMA reduction {kind} on {value.dtype.scalar}: only fp32 add")
    ptrs, mask = desc.materialize_pointers(indices)
    self.create_atomic_rmw(interp._ir.ATOMIC_OP.FADD, ptrs, value, mask, interp._ir.MEM_SEMANTIC.RELAXED,
                           interp._ir.MEM_SYNC_SCOPE.GPU)


def apply():
    if not triton.__version__.startswith(CHECKED_VERSIONS):
        raise RuntimeError(f"nanolp/interp_patch.py was checked on triton {CHECKED_VERSIONS}, found "
                           f"{triton.__version__}: re-check it (run tests/test_interp_patch.py) and extend the list")
    _Builder.cast_impl = _cast_impl
    _Builder.create_dot = _create_dot
    _Builder.binary_op = _binary_op
    _Builder.unary_op = _unary_op
    _Reduce.sum = _sum
    _Reduce.min_max = _min_max
    _Reduce.generic_reduce = _generic_reduce
    _Builder.create_descriptor_reduce = _create_descriptor_reduce
    _Builder.create_exp = lambda self, a: self.unary_op(a, _exact_f32(np.exp))
    _Builder.create_exp2 = lambda self, a: self.unary_op(a, _exact_f32(np.exp2))
    _Builder.create_log = lambda self, a: self.unary_op(a, _exact_f32(np.log))
    _Builder.create_log2 = lambda self, a: self.unary_op(a, _exact_f32(np.log2))
    interp.nanolp_bf16_patch = True   # kernels.check_device runs the kernel under the interpreter only with this


# ---------------------------------------------------------------------------------------------------------
# Self-test: run before the suite; any failure means the kernel tests below would prove nothing.

@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))


@triton.jit
def _dot_kernel(A, B, C, M: tl.constexpr):
    offs = tl.arange(0, M)
    a = tl.load(A + offs[:, None] * M + offs[None, :])
    b = tl.load(B + offs[:, None] * M + offs[None, :])
    tl.store(C + offs[:, None] * M + offs[None, :], tl.dot(a, b))


@triton.jit
def _exp2_sum_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y, tl.sum(tl.math.exp2(tl.load(X + offs)), 0))


@triton.jit
def _fma_kernel(A, B, C, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, tl.fma(tl.load(A + offs), tl.load(B + offs), tl.load(C + offs)))


def self_test():
    """Raise AssertionError unless bf16 casts round to nearest even, bf16 dots are real products, fp32
    exp2/sum are the exactly rounded values the emulation computes, and tl.fma rounds once."""
    g = torch.Generator().manual_seed(0)
    # exact ties (low 16 bits 0x8000) with odd and even kept mantissas, plus random values
    ties = torch.arange(0x3F800000, 0x3F800000 + 512 * 0x10000, 0x10000, dtype=torch.int64) + 0x8000
    x = torch.cat([ties.to(torch.int32).view(torch.float32), torch.randn(512, generator=g) * 100])
    y = torch.empty(1024, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, N=1024)
    wrong = (y.view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)).sum().item()
    assert wrong == 0, f"interpreter bf16 cast is not round-to-nearest-even ({wrong}/1024 differ): patch inactive"
    a = torch.randn(32, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(32, 32, generator=g).to(torch.bfloat16)
    c = torch.empty(32, 32)
    _dot_kernel[(1,)](a, b, c, M=32)
    ref = (a.double() @ b.double()).float()
    assert torch.equal(c, ref), "interpreter bf16 tl.dot is not the exactly rounded product: patch inactive"
    x = torch.randn(64, generator=g) * 10
    y = torch.empty(1)
    _exp2_sum_kernel[(1,)](x, y, N=64)
    assert torch.equal(y[0], torch.exp2(x.double()).float().double().sum().float()), \
        "interpreter fp32 exp2/sum are not exactly rounded: patch inactive"
    # a * b + c = 1 + 3 * 2^-24 - 2^-60, just below a float32 midpoint: rounded once it is 1 + 2^-23; rounded to
    # float64 first it lands on the midpoint, which float32 breaks to the even 1 + 2^-22
    a, b, c = (torch.tensor([x, x], dtype=torch.float32) for x in (1 + 2**-18, 2**-24 * (1 - 2**-18), 1 + 2**-23))
    out = torch.empty(2)
    _fma_kernel[(1,)](a, b, c, out, N=2)
    assert torch.equal(out, c), "interpreter tl.fma rounds twice: kernels._exp2's fused form would not be emulated"
