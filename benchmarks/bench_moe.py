"""Benchmark the quantized MoE layer against its floor and the references, on the GPU.

For each shape (Qwen3-30B-A3B, Mixtral-8x7B, a DeepSeek-V3 layer), format (int4 group 128
in the kernel layout and NVFP4 by default, the issues' two; `--formats w4a16-g128-zp` adds
int4 with zero points, as AWQ stores it) and token count M, it times with CUDA events,
after warm-up, with the L2 cache flushed before every run, the median of many runs of:

* gemm_ms:  the two grouped GEMMs as the layer runs them (routing and alignment done
            beforehand; replayed launches, gemm2 launched early unless
            NUMBA_MOE_EARLY_LAUNCH=0, its first weight loads issued before it waits for
            gemm1), from a CUDA graph: a tile with `fused_reduction` also finishes the
            reduction after it (activation, combine); at M <= 16 also gemm_plain_ms, the
            two GEMMs writing partials only (the earlier runs' gemm_ms), and read_ms, two
            plain read kernels of the bytes the two GEMMs read (`reads.py`: what merely
            streaming those bytes costs in two short kernels, launch and ramp included);
* layer_ms: the whole layer (routing to combine), replayed from a CUDA graph;
* torch_ms: the torch reference, dequantised bf16 experts multiplied in a loop over experts;
* grouped_mm_ms: torch._grouped_mm on bf16 experts (CUTLASS tensor cores), for comparison;

at M <= 16 each kernel of the layer alone (a CUDA graph per kernel: where the time beyond
the GEMMs goes), and at M = 1 the eager layer from Python: replayed (the default, one
graph launch a forward) and with ordinary Numba launches, per forward: wall time and the
host's time until the last call returns, per forward and per kernel (median of five
rounds of 100 forwards; the L2 is not flushed between them). The floor of the
two GEMMs is max(bytes of the touched experts' weights / copy bandwidth, flops / bf16
matmul rate), both ceilings measured in the same run. Weights are random
bits written straight into the kernel layout (timing does not depend on their values;
correctness is the tests' job). Each row names the GPU whose tuned table chose its tiles
(`tuned_on`: this one, another of its architecture, or None for the heuristic;
NUMBA_MOE_TUNED=0 times the heuristic's tiles). A shape's rows are timed by token count,
every format's at each count, so that no decode row follows a prefill row; the JSON lists
them in the table's order.

    python benchmarks/bench_moe.py --json results.json [--shapes qwen3 mixtral] [--tokens 1 16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import time

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from moe import MoEConfig, MoEHooks, MoELayer, QuantScheme, check_inputs, prepare
from moe.oracle import tuned_entries
from moe.runner import fused_activation, fused_combine, specialized_gemm1, specialized_gemm2
from numba_kernels import interop
from numba_kernels.gemm import grouped_gemm
from numba_kernels.launch import EARLY_LAUNCH, Launcher, recording, replaying
from bench_table import source_digest
from compare_trees import parse_job
from reads import PlainReads

SHAPES = {"qwen3": dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),
          "mixtral": dict(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
          "deepseek": dict(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048)}
FORMATS = {"w4a16-g128": QuantScheme("native", bits=4, group_size=128), "nvfp4": QuantScheme("nvfp4"),
           "w4a16-g128-zp": QuantScheme("native", bits=4, group_size=128, symmetric=False)}
ISSUE_FORMATS = ["w4a16-g128", "nvfp4"]  # the formats the issues' targets name: every script's default
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def job_config(job: str) -> tuple[MoEConfig, int]:
    """(the layer's config, M) of a job, shape:format:M (`compare_trees.parse_job`)."""
    shape, format_name, tokens = parse_job(job)
    if shape not in SHAPES or format_name not in FORMATS:
        raise ValueError(f"{job!r} names no shape of {list(SHAPES)} or no format of {list(FORMATS)}")
    return MoEConfig(**SHAPES[shape], quant=FORMATS[format_name]), tokens

REFERENCE_FIGURES = """Reference figures (H100, from the issues; two GEMMs, same floor definition):
  vLLM Marlin MoE:   Qwen3 M=1 0.029 ms (0.22), M=16 0.105 ms (0.59), M=256 0.195 ms (0.53), M=4096 1.308 ms (0.30)
                     Mixtral M=1 0.101 ms (0.60), M=16 0.259 ms (0.82), M=256 0.945 ms (0.26), M=4096 10.18 ms (0.36)
  vLLM Triton W4A16: Qwen3 M=1/16/4096 0.059 / 0.467 / 2.264 ms; Mixtral 0.466 / 1.579 / 17.15 ms
  torch._grouped_mm (bf16): Qwen3 M=1 0.071 ms, M=4096 0.893 ms; Mixtral M=1 0.299 ms, M=4096 4.974 ms"""


class Timer:
    """Median CUDA-event time of a function, with the L2 flushed before each run.

    flush="read" (the default) sums a buffer far larger than the L2, leaving it full of
    clean lines; flush="write" zeroes it instead (the previous runs' method), which leaves
    dirty lines that the timed kernel pays to write back: 2 to 4 us more per pair of
    decode GEMMs on the H200 (2026-11-23), a tenth of Qwen3's at M = 1."""

    def __init__(self, flush_bytes: int = 512 << 20, flush: str = "read"):
        if flush not in ("read", "write"):
            raise ValueError(f"flush must be 'read' or 'write', got {flush!r}")
        self.flush_buffer = torch.zeros(flush_bytes // 8, dtype=torch.int64, device="cuda")
        self.flush_mode = flush

    def flush(self) -> None:
        if self.flush_mode == "read":
            self.flush_buffer.sum()
        else:
            self.flush_buffer.zero_()

    def __call__(self, fn, repeats: int = 30, flush: bool = True, prepare=None) -> float:
        """`prepare`, if given, runs after each flush, outside the timed span."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            if flush:
                self.flush()
            if prepare is not None:
                prepare()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def copy_bandwidth(timer: Timer) -> float:
    """Bytes per second of a 2 GiB device copy, counting bytes read and written."""
    source = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = timer(lambda: target.copy_(source), repeats=10, flush=False)
    return 2 * source.numel() / (ms * 1e-3)


def matmul_rate(timer: Timer) -> float:
    """bf16 flops per second of an 8192^3 matrix product on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timer(lambda: a @ b, repeats=10, flush=False)
    return 2 * 8192 ** 3 / (ms * 1e-3)


def routing_for(config: MoEConfig, tokens: int, generator: torch.Generator):
    logits = torch.randn(tokens, config.num_experts, generator=generator, device="cuda")
    topk = torch.topk(torch.softmax(logits, dim=-1), config.top_k, dim=-1)
    return logits, topk.values.float().contiguous(), topk.indices.to(torch.int32).contiguous()


class TorchReference:
    """Dequantised bf16 experts, multiplied in a loop (and with torch._grouped_mm)."""

    def __init__(self, config: MoEConfig):
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5
        self.w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i ** 0.5
        self.intermediate = i

    def prepare(self, hidden: torch.Tensor, topk_ids: torch.Tensor):
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.w13.shape[0])
        self.rows = (order // topk_ids.shape[1])
        self.counts = counts.cpu().tolist()
        self.offsets = torch.cumsum(counts, 0).to(torch.int32)
        self.x = hidden[self.rows].contiguous()

    def loop(self):
        start = 0
        for expert, count in enumerate(self.counts):
            if count:
                x = self.x[start:start + count]
                gate_up = x @ self.w13[expert].T
                y = torch.nn.functional.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
                y @ self.w2[expert].T
                start += count

    def grouped_mm(self):
        gate_up = torch._grouped_mm(self.x, self.w13.transpose(-2, -1), offs=self.offsets)
        y = torch.nn.functional.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
        torch._grouped_mm(y, self.w2.transpose(-2, -1), offs=self.offsets)


def routed_batches(shapes, formats, tokens, generator: torch.Generator):
    """(shape, format name, M, layer, hidden, topk_weights, topk_ids) for every shape,
    format and token count: one layer per shape and format, its weights random bits, and a
    fresh batch and routing per token count (the decode bounds' rows)."""
    for shape in shapes:
        for format_name in formats:
            layer = MoELayer(MoEConfig(**SHAPES[shape], quant=FORMATS[format_name]), max_tokens=max(tokens))
            layer.weights.fill_random(seed=1)
            for count in tokens:
                hidden = torch.randn(count, layer.config.hidden_size, generator=generator, device="cuda")
                _, topk_weights, topk_ids = routing_for(layer.config, count, generator)
                yield shape, format_name, count, layer, hidden.to(torch.bfloat16), topk_weights, topk_ids
            del layer
            torch.cuda.empty_cache()


def captured(fn):
    """`fn` captured in a CUDA graph after a warm-up call (which compiles its kernels):
    replays show GPU time, not Python's launch overhead."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def gemm_bytes(layer: MoELayer, touched: int) -> tuple[int, int]:
    """Bytes of the touched experts' weights and scales that gemm1 and gemm2 read."""
    experts = layer.config.num_local_experts
    return tuple(int(stored.nbytes() / experts * touched) for stored in (layer.weights.w13, layer.weights.w2))


def layer_gemms(layer: MoELayer, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                own_counters: bool = False):
    """(gemm1, gemm2, backend) for a routed batch, aligned beforehand: the layer's two
    grouped GEMMs as it launches them, each a function of `fused` (True: with the reduction
    its tile finishes, as the layer runs it; False: partials or outputs only). gemm2 is
    launched early where it may be (alignment_ready). `own_counters`: gemm2's fused
    reduction counts arrivals in a buffer of its own, so that the two may run side by side."""
    config = layer.config
    inputs = check_inputs(config, layer.weights, layer.workspace, hidden, topk=(topk_weights, topk_ids),
                          check_ids=False)
    prepared = prepare(config, layer.weights, layer.workspace, inputs)
    buffers, backend, slots = prepared.buffers, prepared.backend, topk_ids.numel()
    alignment = (buffers.sorted_token_ids, buffers.expert_ids, buffers.num_tokens_post_padded)
    arrivals2 = torch.zeros_like(buffers.arrivals) if own_counters else buffers.arrivals
    tile, blocks = backend.specialized, (buffers.picks, buffers.stage_blocks)
    if tile is not None:  # the warp-specialised pair, its gather and activation included
        return (lambda fused=True: specialized_gemm1(config, layer.weights, hidden, alignment, slots, tile, *blocks,
                                                     buffers.gemm1_out),
                lambda fused=True: specialized_gemm2(layer.weights, alignment, tile, *blocks, buffers.gemm2_out),
                backend)
    then1 = fused_activation(config, backend.gemm1, buffers.intermediate, buffers.arrivals)
    then2 = fused_combine(config, backend.gemm2, prepared.topk_weights, buffers.output, arrivals2)

    def gemm1(fused: bool = True) -> None:
        grouped_gemm(hidden, layer.weights.w13, *alignment, num_slots=slots, tile=backend.gemm1, out=buffers.gemm1_out,
                     then=then1 if fused else None, check_ids=False)

    def gemm2(fused: bool = True) -> None:
        grouped_gemm(buffers.intermediate, layer.weights.w2, *alignment, num_slots=slots, tile=backend.gemm2,
                     out=buffers.gemm2_out, then=then2 if fused else None, alignment_ready=True, check_ids=False)

    return gemm1, gemm2, backend


def best_times(timer, layer: MoELayer, hidden, logits, topk_weights, topk_ids, attempts: int = 3) -> tuple:
    """(GEMMs ms, layer ms, backend): each the best of `attempts` medians of 40 replays,
    the GEMMs as `layer_gemms` launches them (side-by-side comparisons: compare_trees.py,
    specialized_ab.py)."""
    gemm1, gemm2, backend = layer_gemms(layer, hidden, topk_weights, topk_ids)

    def gemms():
        gemm1()
        gemm2()

    gemm_ms = min(timer(captured(replaying(gemms)), repeats=40) for _ in range(attempts))
    layer_ms = min(timer(captured(lambda: layer(hidden, logits)), repeats=40) for _ in range(attempts))
    return gemm_ms, layer_ms, backend


def bench_row(timer, layer, reference, tokens, generator, bandwidth, rate) -> dict:
    config = layer.config
    hidden = (torch.randn(tokens, config.hidden_size, generator=generator, device="cuda")).to(torch.bfloat16)
    logits, topk_weights, topk_ids = routing_for(config, tokens, generator)
    gemm1, gemm2, backend = layer_gemms(layer, hidden, topk_weights, topk_ids)
    slots = topk_ids.numel()

    def gemms(fused=True):
        gemm1(fused)
        gemm2(fused)

    gemm_ms = timer(captured(replaying(gemms)))
    layer_ms = timer(captured(lambda: layer(hidden, logits)))

    touched = int(torch.unique(topk_ids).numel())
    flops = 2 * slots * (config.gate_up_size * config.hidden_size + config.hidden_size * config.intermediate_size)
    floor_ms = max(sum(gemm_bytes(layer, touched)) / bandwidth, flops / rate) * 1e3
    reference.prepare(hidden, topk_ids)
    torch_ms = timer(reference.loop, repeats=10)
    try:
        grouped_mm_ms = timer(reference.grouped_mm, repeats=10)
    except (RuntimeError, AttributeError) as error:
        grouped_mm_ms = None
        print(f"  torch._grouped_mm unavailable: {str(error).splitlines()[0]}")
    row = dict(M=tokens, experts_touched=touched, gemm_ms=gemm_ms, layer_ms=layer_ms, floor_ms=floor_ms,
               fraction_of_floor=floor_ms / gemm_ms, layer_over_gemm=layer_ms / gemm_ms, torch_ms=torch_ms,
               grouped_mm_ms=grouped_mm_ms, backend=repr(backend))
    if tokens <= 16:
        row["gemm_plain_ms"] = timer(captured(replaying(lambda: gemms(fused=False))))
        reads = PlainReads(gemm_bytes(layer, touched))
        row["read_ms"] = timer(captured(replaying(reads)))
        del reads
        row["kernel_us"] = kernel_times(layer, hidden, logits, timer)
    if tokens == 1:
        row.update(eager_host(layer, hidden, logits))
        row["eager_over_layer"] = row["eager_layer_ms"] / layer_ms
    return row


def kernel_times(layer, hidden, logits, timer) -> list:
    """[kernel name, GPU microseconds] for each launch of the layer, in order, each kernel
    replayed alone from its own CUDA graph: where the layer's time beyond the GEMMs goes."""
    layer.hooks = MoEHooks()  # ordinary launches, recorded
    with recording() as calls:
        layer(hidden, logits)
    layer.hooks = None
    times = []
    for call in calls:
        launcher = Launcher(call)
        replay = captured(lambda: launcher.launch(interop.launch_stream_handle()))
        times.append([call.kernel.py_func.__name__, round(timer(replay, repeats=20) * 1e3, 2)])
    return times


def eager_host(layer, hidden, logits) -> dict:
    """The eager layer from Python, replayed (the default: launches recorded on the first
    call, then one CUDA graph launch a call) and with ordinary Numba launches (what a hook
    forces): wall time per forward, and the host's share of it, the time until the last
    call returns (the GPU's queue takes 100 forwards without blocking)."""
    def timed(repeats: int = 100, rounds: int = 5) -> tuple[float, float]:
        """(wall ms, host ms) per forward, each the median over `rounds` of the mean of
        `repeats` calls: one round alone caught a host hiccup that doubled the figure (Qwen3
        M = 1 on the H200 host: 69 against 35 us)."""
        for _ in range(5):
            layer(hidden, logits)
        walls, hosts = [], []
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                layer(hidden, logits)
            issued = time.perf_counter()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - start) * 1e3 / repeats)
            hosts.append((issued - start) * 1e3 / repeats)
        return statistics.median(walls), statistics.median(hosts)

    replayed_ms, host_ms = timed()
    layer.hooks = MoEHooks()  # any hooks object turns the replay off
    with recording() as calls:
        layer(hidden, logits)
    ordinary_ms, _ = timed()
    layer.hooks = None
    kernels = len(calls)
    return dict(eager_layer_ms=replayed_ms, eager_host_us=host_ms * 1e3, host_us_per_kernel=host_ms * 1e3 / kernels,
                eager_ordinary_ms=ordinary_ms, ordinary_us_per_kernel=ordinary_ms * 1e3 / kernels, kernels=kernels)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=ISSUE_FORMATS, choices=list(FORMATS))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--json", default="bench_moe.json", help="where to write the rows")
    parser.add_argument("--flush", default="read", choices=["read", "write"], help="how to flush the L2 (see Timer)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("it times the layer on a CUDA GPU and none is available here (python -m moe runs without one)")

    timer = Timer(flush=args.flush)
    bandwidth, rate = copy_bandwidth(timer), matmul_rate(timer)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    sources = source_digest(pathlib.Path(__file__).resolve().parent.parent)  # the tree timed, whatever git says
    header = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit,
                  sources=sources, l2_flush=args.flush, early_launch=EARLY_LAUNCH,
                  copy_bandwidth_TBps=bandwidth / 1e12, bf16_matmul_TFLOPs=rate / 1e12)
    print(json.dumps(header))
    print(REFERENCE_FIGURES)
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        reference = TorchReference(MoEConfig(**SHAPES[shape]))
        layers = {}  # format -> (layer, the GPU whose tuned table chose its tiles)
        for format_name in args.formats:
            config = MoEConfig(**SHAPES[shape], quant=FORMATS[format_name])
            layer = MoELayer(config, max_tokens=max(args.tokens))
            layer.weights.fill_random(seed=1)
            tuned_on = tuned_entries(config, layer.weights.spec)[0]
            layers[format_name] = layer, tuned_on
            print(f"{shape} {format_name}: tiles tuned on {tuned_on}" if tuned_on else
                  f"{shape} {format_name}: untuned (the oracle's heuristic)")
        # Token counts outermost: every format's decode rows are timed before any prefill row,
        # whose seconds of work can leave the card slower for a while (the fifty-first
        # session's DeepSeek NVFP4 M = 1 took 0.0918 ms after the w4a16 rows, 0.0798 alone).
        for tokens in sorted(args.tokens):
            for format_name, (layer, tuned_on) in layers.items():
                row = dict(shape=shape, format=format_name, tuned_on=tuned_on,
                           **bench_row(timer, layer, reference, tokens, generator, bandwidth, rate))
                rows.append(row)
                print_row(row)
                rows.sort(key=table_order(args.shapes, args.formats))
                with open(args.json, "w") as f:  # after every row: a timed-out run keeps its rows
                    json.dump(dict(header, rows=rows), f, indent=1)
        del layers, layer, reference
        torch.cuda.empty_cache()


def table_order(shapes: list[str], formats: list[str]):
    """The sort key that lists rows shape by shape, format by format, by token count (the
    table's order), whatever order they were timed in."""
    return lambda row: (shapes.index(row["shape"]), formats.index(row["format"]), row["M"])


def print_row(row: dict) -> None:
    print(f"{row['shape']:9s} {row['format']:11s} M={row['M']:5d} touched={row['experts_touched']:3d} "
          f"gemm {row['gemm_ms']:.4f} ms  layer {row['layer_ms']:.4f} ms  floor {row['floor_ms']:.4f} ms "
          f"({row['fraction_of_floor']:.2f})  torch {row['torch_ms']:.4f} ms  grouped_mm "
          f"{row['grouped_mm_ms'] or float('nan'):.4f} ms"
          + (f"  eager {row['eager_layer_ms']:.3f} ms (host {row['eager_host_us']:.1f} us for "
             f"{row['kernels']} kernels, {row['eager_over_layer']:.2f}x the graph; ordinary launches "
             f"{row['eager_ordinary_ms']:.3f} ms)" if "eager_layer_ms" in row else "")
          + (f"\n    GEMMs writing partials only {row['gemm_plain_ms']:.4f} ms; plain reads of their bytes "
             f"{row['read_ms']:.4f} ms (GEMMs {row['gemm_ms'] / row['read_ms']:.2f}x); per kernel (us): "
             f"{row['kernel_us']}" if "kernel_us" in row else ""), flush=True)


if __name__ == "__main__":
    main()
