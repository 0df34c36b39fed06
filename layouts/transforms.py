"""Elementary layout transforms: small invertible maps on the last two axes of a tensor.

A transform maps a logical 2-D grid of shape ``(rows, cols)`` (the trailing axes; leading
axes such as the MoE expert axis pass through untouched) onto a physical grid. Each one is
defined by a single *index map* ``(i, j) -> (i2, j2)`` written with integer arithmetic and
constant-table lookups only, so the same function runs

* vectorised on numpy index arrays (that is how ``Layout.pack`` / ``unpack`` work), and
* as a Numba device function inside a kernel (``numba_kernels`` wraps it with ``cuda.jit``).

There is no separate forward or inverse code to drift out of sync: pack scatters through
the index map, unpack gathers through it. The final ``BitPack`` step maps an element to a
word and a bit offset, ``(i, j) -> (i2, j2, shift)`` (where its bits start, or with
``BitPack.places`` where its slot starts before the bits are scattered).

Example (GPTQ 4-bit): ``Layout((Transpose(), BitPack(4, axis=-2)))`` takes codes ``(N, K)``
to ``(K, N)`` and packs 8 consecutive K rows into one int32 word.
"""

from __future__ import annotations

import attrs
import numpy as np

Shape = tuple[int, int]


def _check_axis(instance, attribute, value):
    if value not in (-1, -2):
        raise ValueError(f"{attribute.name} must be -1 (columns) or -2 (rows), got {value!r}")


def _check_positive(instance, attribute, value):
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _as_int_tuple(value) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _check_permutation(instance, attribute, value):
    if sorted(value) != list(range(len(value))):
        raise ValueError(f"{attribute.name} must be a permutation of 0..{len(value) - 1}, got {value!r}")


def _optional_permutation(length, unit: str):
    """Validator: None, or a permutation of range(length(instance)) (`unit` says what it counts)."""
    def check(instance, attribute, value):
        if value is None:
            return
        if len(value) != length(instance):
            raise ValueError(f"{attribute.name} must have {length(instance)} entries ({unit}), got {len(value)}")
        _check_permutation(instance, attribute, value)

    return check


def _inverse_table(perm: tuple[int, ...]) -> np.ndarray:
    """inv[old] = new for a permutation given as perm[new] = old (numpy fancy-index convention)."""
    return np.argsort(np.asarray(perm)).astype(np.int64)


def _require_multiple(what: str, size: int, multiple: int, transform) -> None:
    if size % multiple:
        raise ValueError(f"{transform!r} needs {what} to be a multiple of {multiple}, got {size}")


@attrs.frozen
class Transpose:
    """(i, j) -> (j, i): the engines' (K, N) matrices versus the logical (N, K)."""

    def out_shape(self, shape: Shape) -> Shape:
        return shape[1], shape[0]

    in_shape = out_shape

    def index_fn(self, shape: Shape):
        def transpose(i, j):
            return j, i

        return transpose

    def __repr__(self) -> str:
        return "Transpose()"


@attrs.frozen
class Pad:
    """Zero padding of rows and columns up to multiples; the index map is the identity."""

    rows: int = attrs.field(default=1, validator=_check_positive)
    cols: int = attrs.field(default=1, validator=_check_positive)

    def out_shape(self, shape: Shape) -> Shape:
        return -(-shape[0] // self.rows) * self.rows, -(-shape[1] // self.cols) * self.cols

    def in_shape(self, shape: Shape) -> Shape:
        return shape  # the padded shape: the unpadded one is not recoverable from it

    def index_fn(self, shape: Shape):
        def pad(i, j):
            return i, j

        return pad

    def __repr__(self) -> str:
        return f"Pad({self.rows}, {self.cols})"


@attrs.frozen
class Tile:
    """Cut the grid into (rows x cols) tiles; each output row holds one row of tiles, each
    tile flattened row-major: (R, C) -> (R/rows, C*rows). Marlin uses Tile(16, 16) on (K, N)."""

    rows: int = attrs.field(validator=_check_positive)
    cols: int = attrs.field(validator=_check_positive)

    def out_shape(self, shape: Shape) -> Shape:
        _require_multiple("rows", shape[0], self.rows, self)
        _require_multiple("cols", shape[1], self.cols, self)
        return shape[0] // self.rows, shape[1] * self.rows

    def in_shape(self, shape: Shape) -> Shape:
        return shape[0] * self.rows, shape[1] // self.rows

    def index_fn(self, shape: Shape):
        self.out_shape(shape)
        rows, cols, size = self.rows, self.cols, self.rows * self.cols

        def tile(i, j):
            return i // rows, (j // cols) * size + (i % rows) * cols + j % cols

        return tile

    def __repr__(self) -> str:
        return f"Tile({self.rows}, {self.cols})"


@attrs.frozen
class Panels:
    """Store the grid in column panels `cols` wide, each panel's rows one after another,
    the shape kept: (i, j) goes to flat place (j // cols) * R * cols + i * cols + j % cols.
    A column range that one CTA reads over all rows becomes one contiguous run."""

    cols: int = attrs.field(validator=_check_positive)

    def out_shape(self, shape: Shape) -> Shape:
        _require_multiple("cols", shape[1], self.cols, self)
        return shape

    def in_shape(self, shape: Shape) -> Shape:
        return shape

    def index_fn(self, shape: Shape):
        self.out_shape(shape)
        rows, cols, width = shape[0], self.cols, shape[1]

        def panel(i, j):
            place = (j // cols) * rows * cols + i * cols + j % cols
            return place // width, place % width

        return panel

    def __repr__(self) -> str:
        return f"Panels({self.cols})"


@attrs.frozen
class Permute:
    """Permute each consecutive chunk of len(perm) elements along an axis.

    Convention as numpy/torch write it: new position p takes old position perm[p]
    (``x.reshape(-1, L)[:, perm]``). Marlin's weight and scale permutations, the AWQ
    nibble interleave and TensorRT-LLM's row shuffles are all of this form.
    """

    perm: tuple[int, ...] = attrs.field(converter=_as_int_tuple, validator=_check_permutation)
    axis: int = attrs.field(default=-1, validator=_check_axis)

    def out_shape(self, shape: Shape) -> Shape:
        _require_multiple("rows" if self.axis == -2 else "cols", shape[self.axis], len(self.perm), self)
        return shape

    def in_shape(self, shape: Shape) -> Shape:
        return shape

    def index_fn(self, shape: Shape):
        self.out_shape(shape)
        length, inverse = len(self.perm), _inverse_table(self.perm)
        if self.axis == -1:
            def permute_cols(i, j):
                return i, (j // length) * length + inverse[j % length]

            return permute_cols

        def permute_rows(i, j):
            return (i // length) * length + inverse[i % length], j

        return permute_rows

    def __repr__(self) -> str:
        shown = ",".join(map(str, self.perm[:8])) + (",..." if len(self.perm) > 8 else "")
        return f"Permute([{shown}] (len {len(self.perm)}), axis={self.axis})"


@attrs.frozen
class _HalvesReorder:
    """A reorder of the two halves of an axis (of even length): the shape stays."""

    axis: int = attrs.field(default=-2, validator=_check_axis)

    def out_shape(self, shape: Shape) -> Shape:
        _require_multiple("rows" if self.axis == -2 else "cols", shape[self.axis], 2, self)
        return shape

    def in_shape(self, shape: Shape) -> Shape:
        return shape

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axis={self.axis})"


@attrs.frozen(repr=False)
class InterleaveHalves(_HalvesReorder):
    """Interleave the two halves of an axis: new 2i <- old i, new 2i+1 <- old n/2 + i.

    TensorRT-LLM's gated-activation reorder: [gate; up] rows become gate/up pairs."""

    def index_fn(self, shape: Shape):
        self.out_shape(shape)
        half = shape[self.axis] // 2
        # x // half is 0 in the first half and 1 in the second (written inline so the
        # same function compiles as a Numba device function).
        if self.axis == -1:
            def interleave_cols(i, j):
                return i, 2 * (j - (j // half) * half) + j // half

            return interleave_cols

        def interleave_rows(i, j):
            return 2 * (i - (i // half) * half) + i // half, j

        return interleave_rows


@attrs.frozen(repr=False)
class SwapHalves(_HalvesReorder):
    """Swap the two halves of an axis: [a; b] -> [b; a] (vLLM's w1/w3 -> w3/w1 reorder)."""

    def index_fn(self, shape: Shape):
        self.out_shape(shape)
        size, half = shape[self.axis], shape[self.axis] // 2
        if self.axis == -1:
            def swap_cols(i, j):
                return i, (j + half) % size

            return swap_cols

        def swap_rows(i, j):
            return (i + half) % size, j

        return swap_rows


@attrs.frozen
class PadHalves:
    """Zero-pad each half of an axis on its own to a multiple: [a; b] -> [a, 0; b, 0]
    (gated w13 weights padded per gate/up half, as vLLM aligns the intermediate size)."""

    multiple: int = attrs.field(validator=_check_positive)
    axis: int = attrs.field(default=-2, validator=_check_axis)

    def _padded_half(self, size: int) -> int:
        return -(-(size // 2) // self.multiple) * self.multiple

    def out_shape(self, shape: Shape) -> Shape:
        _require_multiple("rows" if self.axis == -2 else "cols", shape[self.axis], 2, self)
        padded = 2 * self._padded_half(shape[self.axis])
        return (shape[0], padded) if self.axis == -1 else (padded, shape[1])

    def in_shape(self, shape: Shape) -> Shape:
        return shape  # the padded shape

    def index_fn(self, shape: Shape):
        self.out_shape(shape)
        half, gap = shape[self.axis] // 2, self._padded_half(shape[self.axis]) - shape[self.axis] // 2
        # The second half moves up by the first half's padding (inline, as above).
        if self.axis == -1:
            def pad_cols(i, j):
                return i, j + (j // half) * gap

            return pad_cols

        def pad_rows(i, j):
            return i + (i // half) * gap, j

        return pad_rows

    def __repr__(self) -> str:
        return f"PadHalves({self.multiple}, axis={self.axis})"


@attrs.frozen
class Swizzle128x4:
    """The 128x4 block-scale swizzle of the NVFP4 cutlass / TensorRT-LLM kernels.

    Rows pad to a multiple of 128 and columns to 4 (zero bytes). Each 128x4 tile is 512
    contiguous bytes; tiles run along columns first, then rows; inside a tile row r sits
    at (r % 32) * 16 + (r // 32) * 4. The physical array keeps the padded 2-D shape
    (Mp, Kp) with those bytes in row-major order::

        offset(r, c) = ((r//128) * (Kp//4) + c//4) * 512 + (r%32)*16 + ((r%128)//32)*4 + c%4
    """

    def out_shape(self, shape: Shape) -> Shape:
        return -(-shape[0] // 128) * 128, -(-shape[1] // 4) * 4

    def in_shape(self, shape: Shape) -> Shape:
        return shape  # the padded shape

    def index_fn(self, shape: Shape):
        padded_cols = self.out_shape(shape)[1]
        col_tiles = padded_cols // 4

        def swizzle(i, j):
            offset = ((i // 128) * col_tiles + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
            return offset // padded_cols, offset % padded_cols

        return swizzle

    def __repr__(self) -> str:
        return "Swizzle128x4()"


@attrs.frozen
class BitPack:
    """Pack `bits`-wide codes into words along an axis; always the last step of a layout.

    ``word_bits // bits`` codes share a word; slot s of a word (bits [bits*s, bits*s+bits))
    holds element ``order[s]`` of its chunk (sequential by default; AWQ uses
    [0, 2, 4, 6, 1, 3, 5, 7]). A partial last word is zero padded, as compressed-tensors
    does when K is not a multiple of the pack factor. Words are int32 (32-bit) or uint8.

    `places` scatters the bits: packed bit p (bit p % bits of slot p // bits) is stored at
    word bit ``places[p]`` (a permutation of the word's bits; None: p itself). A kernel
    picks the places its decoder turns into values with the fewest instructions (the
    native NVFP4 layout puts each code's sign and magnitude where a half float wants
    them). The index map's shift stays the slot's first packed bit, bits * s: read and
    write codes through `extract_fn` / `insert_fn`, which apply the places.
    """

    bits: int = attrs.field()
    axis: int = attrs.field(default=-1, validator=_check_axis)
    word_bits: int = attrs.field(default=32)
    order: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_as_int_tuple),
        validator=_optional_permutation(lambda pack: pack.per_word, "codes per word"))
    places: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_as_int_tuple),
        validator=_optional_permutation(lambda pack: pack.word_bits, "bits per word"))

    @bits.validator
    def _check_bits(self, attribute, value):
        if value not in (2, 3, 4, 8):
            raise ValueError(f"bits must be one of 2, 3, 4, 8, got {value!r}")

    @word_bits.validator
    def _check_word(self, attribute, value):
        if value not in (8, 32):
            raise ValueError(f"word_bits must be 8 or 32, got {value!r}")
        if value < self.bits:
            raise ValueError(f"word_bits ({value}) must hold at least one {self.bits}-bit code")

    @property
    def per_word(self) -> int:
        return self.word_bits // self.bits

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.int32 if self.word_bits == 32 else np.uint8)

    def out_shape(self, shape: Shape) -> Shape:
        packed = -(-shape[self.axis] // self.per_word)
        return (shape[0], packed) if self.axis == -1 else (packed, shape[1])

    def in_shape(self, shape: Shape) -> Shape:
        """Assumes full words (pass the shape explicitly where the last word is partial)."""
        return (shape[0], shape[1] * self.per_word) if self.axis == -1 else (shape[0] * self.per_word, shape[1])

    def index_fn(self, shape: Shape):
        per_word, bits = self.per_word, self.bits
        slot = _inverse_table(self.order or tuple(range(per_word)))
        if self.axis == -1:
            def pack_cols(i, j):
                return i, j // per_word, bits * slot[j % per_word]

            return pack_cols

        def pack_rows(i, j):
            return i // per_word, j, bits * slot[i % per_word]

        return pack_rows

    def extract_fn(self):
        """(word, shift) -> the code whose slot starts at packed bit `shift` (numpy arrays
        or, wrapped, a device function: integer operations and one table only)."""
        bits, mask = self.bits, (1 << self.bits) - 1
        if self.places is None:
            def extract(word, shift):
                return (word >> shift) & mask

            return extract
        places = np.asarray(self.places, dtype=np.uint32)

        def extract_placed(word, shift):
            code = (word >> places[shift]) & 1
            for b in range(1, bits):
                code |= ((word >> places[shift + b]) & 1) << b
            return code

        return extract_placed

    def insert_fn(self):
        """(code, shift) -> the code's bits at their places in its word (to OR in)."""
        bits = self.bits
        if self.places is None:
            def insert(code, shift):
                return code << shift

            return insert
        places = np.asarray(self.places, dtype=np.uint32)

        def insert_placed(code, shift):
            word = (code & 1) << places[shift]
            for b in range(1, bits):
                word |= ((code >> b) & 1) << places[shift + b]
            return word

        return insert_placed

    def __repr__(self) -> str:
        order = "" if self.order is None else f", order={list(self.order)}"
        places = "" if self.places is None else f", places={list(self.places)}"
        return f"BitPack({self.bits}, axis={self.axis}, word_bits={self.word_bits}{order}{places})"


def _no_pack(i, j):
    return i, j, 0


def compose(fns, wrap=lambda f: f):
    """Fold index maps left to right into one function.

    `wrap` is applied to every function, the composed ones included, so a kernel factory
    can pass ``cuda.jit(device=True)`` and get a chain of device functions.
    """
    fns = [wrap(f) for f in fns]
    composed = fns[0]
    for step in fns[1:]:
        composed = wrap(_chain(composed, step))
    return composed


def _chain(first, second):
    def chained(i, j):
        a, b = first(i, j)
        return second(a, b)

    return chained


@attrs.frozen
class Layout:
    """A composition of transforms, optionally ending in a BitPack; maps a logical 2-D grid
    (plus any leading batch axes) to one physical array.

    `dtype` is the storage dtype when there is no BitPack (e.g. float16 scales, uint8 fp8).
    """

    steps: tuple = attrs.field(default=(), converter=tuple)
    dtype: str | None = None

    @steps.validator
    def _check_steps(self, attribute, value):
        for position, step in enumerate(value):
            if isinstance(step, BitPack) and position != len(value) - 1:
                raise ValueError("BitPack must be the last step of a layout")

    @property
    def bitpack(self) -> BitPack | None:
        return self.steps[-1] if self.steps and isinstance(self.steps[-1], BitPack) else None

    def shapes(self, shape: Shape) -> list[Shape]:
        """The grid shape before every step and after the last one."""
        shapes = [tuple(shape)]
        for step in self.steps:
            shapes.append(step.out_shape(shapes[-1]))
        return shapes

    def physical_shape(self, shape: Shape) -> Shape:
        return self.shapes(shape)[-1]

    def logical_shape(self, physical_shape: Shape) -> Shape:
        """The logical grid a physical one holds (padding and partial words not undone)."""
        shape = tuple(physical_shape)
        for step in reversed(self.steps):
            shape = step.in_shape(shape)
        return shape

    def index_fns(self, shape: Shape) -> list:
        """Index maps of every step for a logical grid of `shape`; the last returns a shift."""
        fns = [step.index_fn(s) for step, s in zip(self.steps, self.shapes(shape))]
        return fns if self.bitpack else fns + [_no_pack]

    def locate(self, shape: Shape, wrap=lambda f: f):
        """One function (i, j) -> (row, col, bit shift) of the logical element's place."""
        return compose(self.index_fns(shape), wrap)

    def _grid(self, shape: Shape):
        i, j = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
        return self.locate(shape)(i, j)

    def pack(self, values: np.ndarray) -> np.ndarray:
        """Scatter logical values (..., R, C) into the physical array (..., R2, C2)."""
        values = np.asarray(values)
        shape, batch = values.shape[-2:], values.shape[:-2]
        rows, cols, shifts = self._grid(shape)
        out_rows, out_cols = self.physical_shape(shape)
        pack = self.bitpack
        if pack is None:
            out = np.zeros(batch + (out_rows, out_cols), dtype=self.dtype or values.dtype)
            out[..., rows, cols] = values
            return out
        if values.size and (values.min() < 0 or values.max() >= 1 << pack.bits):
            raise ValueError(f"codes must lie in [0, {1 << pack.bits}) to pack into {pack.bits} bits")
        words_per_item = out_rows * out_cols
        items = int(np.prod(batch, dtype=np.int64))
        word = ((np.arange(items)[:, None, None] * words_per_item) + rows * out_cols + cols).ravel()
        shifted = pack.insert_fn()(values.reshape(items, *shape).astype(np.uint64), shifts.astype(np.uint64)).ravel()
        # Every (word, shift) receives one element, so summing disjoint bit fields is an OR.
        words = np.bincount(word, weights=shifted.astype(np.float64), minlength=items * words_per_item)
        words = words.astype(np.uint64).astype(np.uint32 if pack.word_bits == 32 else np.uint8)
        return words.view(pack.dtype).reshape(batch + (out_rows, out_cols))

    def unpack(self, physical: np.ndarray, shape: Shape, name: str = "physical array") -> np.ndarray:
        """Gather the logical (..., R, C) values back from the physical array (`name` names it in errors)."""
        physical = np.asarray(physical)
        expected = self.physical_shape(shape)
        if physical.shape[-2:] != expected:
            raise ValueError(f"{name} has shape {physical.shape}, expected (..., {expected[0]}, {expected[1]})")
        rows, cols, shifts = self._grid(shape)
        pack = self.bitpack
        if pack is None:
            return physical[..., rows, cols]
        words = physical.view(np.uint32 if pack.word_bits == 32 else np.uint8)[..., rows, cols]
        return pack.extract_fn()(words.astype(np.uint32), shifts.astype(np.uint32)).astype(np.int32)

    def __repr__(self) -> str:
        chain = " ∘ ".join(repr(s) for s in reversed(self.steps)) or "identity"
        return chain if self.dtype is None else f"{chain} as {self.dtype}"

