"""The persistent decode-stack kernel (kernels/decode_stack.py) computes the layer-by-layer step."""

from __future__ import annotations

import os

import pytest
import torch

from realtime.engines.transformer import KVCache, Transformer, TransformerConfig

CFG = TransformerConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=32, intermediate_size=512,
                        max_seq_len=160, rope_theta=10000.0)


def _steps(model: Transformer, x: torch.Tensor, prompt: int, stack: bool, programs: int | None = None) -> torch.Tensor:
    """Prefill ``prompt`` positions, then one-token steps over the rest of x [B, T, dim]; the
    outputs [B, T, dim] (float32) and the caches' final K/V."""
    cache = KVCache(model.cfg, n_slots=4, max_seq_len=model.cfg.max_seq_len, device=x.device, dtype=x.dtype)
    b = x.shape[0]
    slots = torch.tensor([2, 0, 3, 1][:b], device=x.device)
    pos = torch.arange(prompt, device=x.device)[None].expand(b, prompt)
    saved = model.stack
    if not stack:
        model.stack = None
    model.stack_programs = programs
    try:
        outs = [model(x[:, :prompt], pos, cache, slots)]
        for i in range(prompt, x.shape[1]):
            outs.append(model(x[:, i:i + 1], torch.full((b, 1), i, device=x.device), cache, slots))
    finally:
        model.stack = saved
    return torch.cat(outs, dim=1).float(), cache.k[:, slots].float(), cache.v[:, slots].float()


def _count_stack_calls(monkeypatch) -> list:  # noqa: ANN001
    """Record each decode_stack call (so a test knows the kernel ran, not the layer loop)."""
    from realtime.kernels import decode_stack as ds

    calls: list = []
    monkeypatch.setattr(ds, "decode_stack", lambda *a, f=ds.decode_stack, **kw: calls.append(1) or f(*a, **kw))
    return calls


def _interpreted(monkeypatch) -> None:  # noqa: ANN001
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA present: the @gpu test covers the stack kernel")
    import realtime.engines.transformer as tr

    monkeypatch.setattr(tr, "_GEMV", "0")
    monkeypatch.setattr(tr, "_fused_layer_loop", lambda x: True)


@pytest.mark.parametrize("rows, programs", [(1, 3), (3, 5), (4, 2)])
def test_stack_equals_layer_by_layer_on_the_interpreter(monkeypatch, rows: int, programs: int) -> None:
    """fp32: the one-kernel step (one phase per launch off the GPU) gives the layer loop's outputs
    and caches, for 1-4 rows at other positions than each other (a prompt past one attention
    chunk), with row splits that leave programs uneven or idle."""
    _interpreted(monkeypatch)
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    model.fuse_projections()
    assert model.enable_decode_stack()
    x = torch.randn(rows, 70, CFG.dim)
    calls = _count_stack_calls(monkeypatch)
    with torch.no_grad():
        ref, rk, rv = _steps(model, x, 66, stack=False)
        assert not calls
        out, k, v = _steps(model, x, 66, stack=True, programs=programs)
    assert len(calls) == 4  # every one-token step
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(k, rk, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(v, rv, rtol=2e-5, atol=2e-5)
    # the stacked weights are the layers' own (views), so loads and state dicts still reach them
    assert model.layers[1].mlp.down_proj.weight.data_ptr() == model.stack.down[1].data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 4])
def test_stack_equals_layer_by_layer_on_cuda(dtype: torch.dtype, tol: float, rows: int) -> None:
    """One launch with grid barriers and L2 prefetches against the layer-by-layer kernels, the same
    weights; no barrier gave up."""
    from realtime.kernels.decode_stack import errors

    torch.manual_seed(0)
    model = Transformer(CFG).eval().to("cuda", dtype)
    model.fuse_projections()
    assert model.enable_decode_stack()
    x = torch.randn(rows, 76, CFG.dim, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref, rk, rv = _steps(model, x, 66, stack=False)
        out, k, v = _steps(model, x, 66, stack=True)
    for a, b in ((out, ref), (k, rk), (v, rv)):
        assert (a - b).norm() / b.norm() < tol
    assert errors(model.stack) == 0


def _cuda_stack(slots: list[int], pos: list[int]):  # noqa: ANN202
    """A bf16 CFG model on CUDA with the stack on, its cache, and one step's inputs for these rows:
    (model, cache, slots, pos, x, cos, sin)."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval().to("cuda", torch.bfloat16)
    model.fuse_projections()
    assert model.enable_decode_stack()
    cache = KVCache(CFG, n_slots=4, max_seq_len=CFG.max_seq_len, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(len(slots), CFG.dim, device="cuda", dtype=torch.bfloat16)
    cos, sin = model.rope_table(cache.max_seq_len, torch.bfloat16)
    return model, cache, torch.tensor(slots, device="cuda"), torch.tensor(pos, device="cuda"), x, cos, sin


@pytest.mark.gpu
def test_both_barriers_give_the_same_step() -> None:
    """The barrier polled by every thread (ONE_POLLER off) computes the step the default one-poller
    barrier does, bit for bit, over repeated launches (the counters keep growing); no timeouts."""
    from realtime.kernels import decode_stack as ds

    model, cache, slots, pos, x, cos, sin = _cuda_stack([2, 0, 3], [5, 90, 17])
    with torch.no_grad():
        want = ds.decode_stack(model.stack, x, pos, cache.k, cache.v, slots, cos, sin)
        for _ in range(3):
            got = ds.decode_stack(model.stack, x, pos, cache.k, cache.v, slots, cos, sin, tune={"ONE_POLLER": False})
            torch.cuda.synchronize()
            assert torch.equal(got, want)
        # the first weight tiles loaded ahead of the barriers, the L2 prefetches: the same products
        for tune in ({"EARLY": 1}, {"EARLY": 1, "GU_ONE_LOOP": False}, {"ATT_PREFETCH": 2}, {"ATT_EARLY": 1},
                     {"PREFETCH": 1}, {"PREFETCH": 9}):
            got = ds.decode_stack(model.stack, x, pos, cache.k, cache.v, slots, cos, sin, tune=tune)
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert ds.errors(model.stack) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("slots, pos", [([2, 0, 3], [5, 90, 17]), ([1], [70]), ([3], [5])])
def test_attention_in_registers_and_fma_masks_give_the_step_on_cuda(slots: list[int], pos: list[int]) -> None:
    """ATT_REGS (the first key block loaded before the barrier, the own key put into it) writes the
    same cache and computes the plain form's step; so do each elementwise GEMV mask at one row,
    alone and with ATT_REGS and ATT_PREFETCH, and the defaults."""
    from realtime.kernels import decode_stack as ds

    model, cache, slots_t, pos_t, x, cos, sin = _cuda_stack(slots, pos)
    cache.k.normal_()
    cache.v.normal_()

    def run(tune=None):  # noqa: ANN001, ANN202
        k, v = cache.k.clone(), cache.v.clone()
        with torch.no_grad():
            h = ds.decode_stack(model.stack, x, pos_t, k, v, slots_t, cos, sin, tune=tune)
        torch.cuda.synchronize()
        return h, k, v

    plain = {"FMA": 0, "ATT_REGS": 0, "ATT_PREFETCH": 0}
    want = run(plain)
    # each switch from the plain form (at one row the defaults hold all three), and the defaults (None)
    tunes = [{**plain, "ATT_REGS": 1}, {**plain, "ATT_REGS": 1, "ATT_PREFETCH": 4}, None]
    if len(slots) == 1:
        tunes += [{**plain, "FMA": 10}, {**plain, "FMA": 5}, {**plain, "FMA": 15, "ATT_REGS": 1},
                  {"FMA": 10, "ATT_REGS": 1, "ATT_PREFETCH": 4}]
    for tune in tunes:
        h, k, v = run(tune)
        torch.testing.assert_close(h, want[0], rtol=1e-2, atol=1e-2, msg=str(tune))
        assert torch.equal(k, want[1]) and torch.equal(v, want[2]), tune
    assert ds.errors(model.stack) == 0


@pytest.mark.gpu
def test_two_programs_an_sm_give_the_step_and_too_many_are_refused() -> None:
    """Four-warp programs, two an SM (the probe's WARPS=4 variant), compute the 8-warp step; a grid
    the GPU cannot hold at once (the barrier would wait forever) is refused before it launches."""
    from realtime.kernels import decode_stack as ds

    model, cache, slots, pos, x, cos, sin = _cuda_stack([2, 0], [33, 120])
    sms = ds.default_programs(x.device)
    with torch.no_grad():
        want = ds.decode_stack(model.stack, x, pos, cache.k, cache.v, slots, cos, sin)
        got = ds.decode_stack(model.stack, x, pos, cache.k, cache.v, slots, cos, sin, programs=2 * sms,
                              tune={"WARPS": 4})
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        with pytest.raises(ValueError, match="resident"):
            ds.decode_stack(model.stack, x, pos, cache.k, cache.v, slots, cos, sin, programs=2 * sms)
    assert ds.errors(model.stack) == 0


@pytest.mark.gpu
def test_traced_step_is_the_step_and_its_stamps_are_ordered() -> None:
    """The probe's traced launch (time stamps at every barrier) computes the same step bit for bit;
    each program's stamps never go back in time; every phase takes time; the summary has a row per
    barrier site and a plausible SM clock."""
    from realtime.kernels import decode_stack as ds

    model, cache, slots, pos, x, cos, sin = _cuda_stack([1, 3], [40, 7])
    p = ds.default_programs(x.device)
    trace = torch.zeros((p, ds.PHASES * CFG.n_layers + 1, 4), dtype=torch.int64, device="cuda")
    with torch.no_grad():
        want = ds.decode_stack(model.stack, x, pos, cache.k, cache.v, slots, cos, sin)
        got = ds.decode_stack(model.stack, x, pos, cache.k, cache.v, slots, cos, sin, trace=trace)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    t = trace.cpu()
    for c in (0, 2):  # SM cycles, global ns: start <= arrival <= release <= next arrival ...
        seq = torch.cat([t[:, :1, c + 1], t[:, 1:, c:c + 2].reshape(p, -1)], dim=1)
        assert bool((seq[:, 1:] >= seq[:, :-1]).all()) and bool((seq[:, -1] > seq[:, 0]).all())
    hz, sites = ds.trace_summary(trace)
    assert 0.5e9 < hz < 3.5e9
    assert [r["site"] for r in sites] == list(range(1, ds.PHASES * CFG.n_layers + 1))
    assert all(r["work_max_us"] >= r["work_mean_us"] >= r["work_min_us"] >= 0 for r in sites)
    assert ds.errors(model.stack) == 0


@pytest.mark.gpu
def test_stack_step_replays_from_a_cuda_graph() -> None:
    """The persistent kernel captured in a CUDA graph (its barrier counter keeps growing across
    replays) gives its eager twin's output at each of several replays."""
    from realtime.kernels.decode_stack import errors

    torch.manual_seed(0)
    model = Transformer(CFG).eval().to("cuda", torch.bfloat16)
    model.fuse_projections()
    assert model.enable_decode_stack()
    cache = KVCache(CFG, n_slots=4, max_seq_len=CFG.max_seq_len, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([1, 3], device="cuda")
    x = torch.randn(2, 40, CFG.dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model(x[:, :30], torch.arange(30, device="cuda")[None].expand(2, 30), cache, slots)
        step_x = x[:, 30:31].clone()
        step_pos = torch.full((2, 1), 30, device="cuda")
        eager = model(step_x, step_pos, cache, slots).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(step_x, step_pos, cache, slots)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(step_x, step_pos, cache, slots)
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)  # the same position rewritten with the same K/V each time
    assert errors(model.stack) == 0


def test_stack_kernel_compiles_for_sm90(tmp_path) -> None:
    """The one-launch form (grid barriers, L2 prefetches) builds for the H200 at Llama-3.2-1B and
    CSM depth-decoder shapes, with the barrier's release arrival, its acquire and the prefetches in
    the PTX, and fits one program per SM (registers and shared memory)."""
    from sm90 import run_script

    run_script(r'''
import os, pathlib, re, subprocess, tempfile
import sm90
import triton
from realtime.kernels import decode_stack as ds
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
tmp = tempfile.mkdtemp()
k = ds._kernels()
sig = {a: "*bf16" for a in k.arg_names if a.endswith("_ptr")}
sig.update(part_ptr="*fp32", ml_ptr="*fp32", cnt_ptr="*i64", trace_ptr="*i64", pos_ptr="*i64", slots_ptr="*i64", eps="fp32",
           qk_scale="fp32", sk_l="i64", sk_s="i64", sk_h="i64", sk_t="i64", s_tab="i64")
aligned = tuple(a for a in sig if a.endswith("_ptr") or a.startswith("sk_") or a == "s_tab")


def check_registers(ptx, name, spill_limit=64):
    # registers: one program per SM must fit, and (nearly) nothing spills (ptxas -v on the PTX)
    ptx_path = pathlib.Path(tmp, name + ".ptx")
    ptx_path.write_text(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx_path), "-o", str(ptx_path.with_suffix(".cubin"))],
                       capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))
    assert regs * 32 * ds._WARPS <= 65536 and spill <= spill_limit, r.stderr
    print(name, regs, "registers,", spill, "bytes spilled")


# (rows, dim, heads, kv heads, head dim, intermediate, layers, cache)
for m, dim, h, hkv, hd, inter, nl, tmax in ((1, 2048, 32, 8, 64, 8192, 16, 272), (4, 2048, 32, 8, 64, 8192, 16, 2048),
                                            (1, 1024, 8, 2, 128, 8192, 4, 32), (1, 2048, 32, 8, 64, 8192, 16, 2048)):
    served = ds.launch_meta(m, dim, h, hkv, hd, inter, nl, tmax, 132, 2, True, False)  # (prefetch on: its PTX is checked)
    # the plain form (no elementwise GEMVs, no attention-window prefetch or registers): the variants below add to it
    meta = {**served, "FMA": 0, "ATT_PREFETCH": 0, "ATT_REGS": 0}
    # as launched: the tensors' pointers and the cache strides are multiples of 16
    c = sm90.compile_sm90(k, sig, {**meta, "BARRIER": True}, warps=ds._WARPS, divisible=aligned)
    ptx = c.asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx, "the GEMV K loops are software-pipelined"
    # the grid barrier (one poller a program, the default): thread 0 arrives and polls; six sites (one
    # before each phase but the first layer's first, one before the final norm), each with its own labels
    assert ptx.count("atom.add.release.gpu.global.u64") == 6 and ptx.count("ld.acquire.gpu.global.u64") == 6
    assert ptx.count("red.global.or.b64") == 6 and len(set(re.findall(r"GB_POLL_\w+:", ptx))) == 6
    # the split counter whose last arrival merges a (row, kv head)'s attention partials
    assert (ptx.count("atom.global.gpu.acq_rel.add") == 1) == (meta["NS"] > 1)
    # six prefetch sites, each emitted once: one request per thread, none repeated across threads
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 6
    assert c.metadata.shared <= 200 * 1024
    if m == 1 and dim == 2048 and tmax == 272:  # the barrier polled by every thread: a release add, polls, an acquire CAS
        every = sm90.compile_sm90(k, sig, {**meta, "BARRIER": True, "ONE_POLLER": False}, warps=ds._WARPS,
                                  divisible=aligned).asm["ptx"]
        assert every.count("atom.global.gpu.release.add") == 6, "one arrival per site"
        assert every.count("atom.global.acquire.gpu.cas") == 6, "the acquire after each wait"
        assert "GB_POLL_" not in every
        # each GEMV's first weight tile loaded ahead of its barrier: builds, pipelined, fits one program per SM
        early = sm90.compile_sm90(k, sig, {**meta, "BARRIER": True, "EARLY": 1}, warps=ds._WARPS, divisible=aligned)
        assert "cp.async.cg.shared.global" in early.asm["ptx"] and early.metadata.shared <= 200 * 1024
        check_registers(early.asm["ptx"], "early", spill_limit=256)  # (a switch, not the default: 148 B spill)
        # the probe's traced step: both clocks read at every barrier's arrival and release, and the start
        traced = sm90.compile_sm90(k, sig, {**meta, "BARRIER": True, "TRACE": True}, warps=ds._WARPS,
                                   divisible=aligned).asm["ptx"]
        assert traced.count("%globaltimer") == traced.count("%clock64") == 2 * 6 + 1
        assert "%globaltimer" not in ptx
        check_registers(traced, "traced", spill_limit=256)
        # the attention-window prefetch by the idle programs: o, gate, up for each program an idle one covers
        att = sm90.compile_sm90(k, sig, {**meta, "BARRIER": True, "ATT_PREFETCH": 4}, warps=ds._WARPS,
                                divisible=aligned).asm["ptx"]
        idle = meta["P"] - meta["M"] * meta["HKV"] * meta["NS"]
        assert att.count("cp.async.bulk.prefetch.L2.global") == 6 + 3 * -(-meta["P"] // idle)
        check_registers(att, "att_prefetch")
        # the elementwise GEMV phases (one row): still software-pipelined, less shared memory, fits
        fma = sm90.compile_sm90(k, sig, {**meta, "BARRIER": True, "FMA": 15}, warps=ds._WARPS, divisible=aligned)
        assert "cp.async.cg.shared.global" in fma.asm["ptx"] and fma.metadata.shared < c.metadata.shared
        check_registers(fma.asm["ptx"], "fma", spill_limit=256)
        # the attention's K/V and angle rows prefetched before its barrier: four more requests
        early_att = sm90.compile_sm90(k, sig, {**meta, "BARRIER": True, "ATT_EARLY": 1}, warps=ds._WARPS,
                                      divisible=aligned).asm["ptx"]
        assert early_att.count("cp.async.bulk.prefetch.L2.global") == 6 + 4
        check_registers(early_att, "att_early")
        # the attention's first key block in registers before its barrier, with every GEMV elementwise
        # and the idle programs' prefetch: builds, fits one program per SM, spills little
        regs = sm90.compile_sm90(k, sig, {**meta, "BARRIER": True, "ATT_REGS": 1, "FMA": 15, "ATT_PREFETCH": 4},
                                 warps=ds._WARPS, divisible=aligned)
        assert regs.metadata.shared <= fma.metadata.shared
        check_registers(regs.asm["ptx"], "att_regs", spill_limit=256)
        # the L2 prefetch as a mask: q|k|v only (at the kernel's start and at each down phase's end)
        qkv_pf = sm90.compile_sm90(k, sig, {**served, "BARRIER": True, "PREFETCH": 1}, warps=ds._WARPS,
                                   divisible=aligned).asm["ptx"]
        dflt_pf = sm90.compile_sm90(k, sig, {**served, "BARRIER": True, "PREFETCH": 0}, warps=ds._WARPS,
                                    divisible=aligned).asm["ptx"]
        assert qkv_pf.count("cp.async.bulk.prefetch.L2.global") == dflt_pf.count("cp.async.bulk.prefetch.L2.global") + 2
        # two 4-warp programs an SM (the probe's WARPS=4): both fit the shared memory and registers
        meta4 = ds.launch_meta(m, dim, h, hkv, hd, inter, nl, tmax, 264, 2, False, False, warps=4)
        four = sm90.compile_sm90(k, sig, {**meta4, "BARRIER": True}, warps=4, divisible=aligned)
        assert 2 * (four.metadata.shared + 1024) <= 233472
        print("4 warps:", four.metadata.shared, "bytes shared")
    check_registers(ptx, f"s{dim}_{m}")
    # the served defaults (at one row: every GEMV elementwise, the idle programs' prefetch, the key block in registers)
    assert (served["FMA"], served["ATT_REGS"]) == ((15, 1) if m == 1 else (0, 0))
    assert served["ATT_PREFETCH"] == (4 if m == 1 and 2 * meta["HKV"] * meta["NS"] <= 132 else 0)
    dflt = sm90.compile_sm90(k, sig, {**served, "BARRIER": True}, warps=ds._WARPS, divisible=aligned)
    assert dflt.metadata.shared <= 200 * 1024
    check_registers(dflt.asm["ptx"], f"served_s{dim}_{m}", spill_limit=256)
print("compiled")
''', tmp_path)


def test_stack_is_opt_in_and_for_one_engine(monkeypatch) -> None:
    """REALTIME_STACK: off by default; "1" gives it to the first engine that asks; a list names
    engines; never two engines in one process."""
    import realtime.engines.transformer as tr

    for value, asks, granted in (("0", ["text", "csm"], [False, False]), ("1", ["csm", "text", "csm"], [True, False, True]),
                                 ("text", ["csm", "text"], [False, True]), ("csm,text", ["text", "csm"], [True, False])):
        monkeypatch.setattr(tr, "_STACK", value)
        monkeypatch.setattr(tr, "_stack_owner", [])
        assert [tr.stack_enabled(e) for e in asks] == granted, value


def test_stack_tune_from_the_environment_reaches_the_kernel(monkeypatch) -> None:
    """REALTIME_STACK_TUNE ("NAME=integer,...") is parsed with a clear error for anything else, and
    the engine's stack step passes it to decode_stack, which refuses names it does not take."""
    _interpreted(monkeypatch)
    import realtime.engines.transformer as tr
    from realtime.kernels import decode_stack as ds

    assert tr._parse_stack_tune("") == {}
    assert tr._parse_stack_tune(" fma=10, ATT_REGS=1 ,") == {"FMA": 10, "ATT_REGS": 1}
    for bad in ("FMA", "FMA=x", "=3"):
        with pytest.raises(ValueError, match="NAME=integer"):
            tr._parse_stack_tune(bad)
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    model.fuse_projections()
    assert model.enable_decode_stack()
    seen: list = []
    monkeypatch.setattr(ds, "decode_stack", lambda *a, f=ds.decode_stack, **kw: seen.append(kw.get("tune")) or f(*a, **kw))
    cache = KVCache(CFG, n_slots=1, max_seq_len=CFG.max_seq_len, device="cpu", dtype=torch.float32)
    step = (torch.randn(1, 1, CFG.dim), torch.full((1, 1), 3), cache, torch.tensor([0]))
    with torch.no_grad():
        monkeypatch.setattr(tr, "_STACK_TUNE", {"FMA": 0, "STAGES": 2})
        model(*step)
        monkeypatch.setattr(tr, "_STACK_TUNE", {"NOT_A_SWITCH": 1})
        with pytest.raises(ValueError, match="tune takes"):
            model(*step)
    assert seen == [{"FMA": 0, "STAGES": 2}, {"NOT_A_SWITCH": 1}]


def test_csm_frames_equal_with_the_stack_on_the_interpreter(monkeypatch, tmp_path) -> None:
    """CSM's backbone and depth-decoder steps through the stack kernel give the same greedy frames
    as the layer-by-layer path (fp32, random weights with head dims the kernel takes)."""
    _interpreted(monkeypatch)
    transformers = pytest.importorskip("transformers")
    from realtime.engines.csm import CSM

    k, v = 4, 37
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    depth = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 rope_parameters=rope)
    cfg = transformers.CsmConfig(
        num_codebooks=k, vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, rope_parameters=rope, text_vocab_size=300, max_position_embeddings=256, pad_token_id=None,
        bos_token_id=290, eos_token_id=291, audio_token_id=292, audio_eos_token_id=293, codebook_pad_token_id=v - 1,
        codebook_eos_token_id=0, attn_implementation="eager",
        depth_decoder_config=dict(num_codebooks=k, backbone_hidden_size=64, vocab_size=v, max_position_embeddings=k, **depth),
        codec_config=transformers.MimiConfig(  # part of the HF model; its weights are not ours to load
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
            codebook_dim=8, codebook_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
            vector_quantization_hidden_dimension=8, num_quantizers=k, num_semantic_quantizers=1, head_dim=8,
            upsample_groups=16).to_dict(),
    )
    torch.manual_seed(0)
    hf = transformers.CsmForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # O(1) activations and separated logits (as tests/engines/test_csm.py does)
        for name, p in hf.named_parameters():
            if not name.startswith("codec_model."):
                p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 * (3 if "head" in name else 1))
    hf.save_pretrained(tmp_path)
    ours = CSM.from_pretrained(tmp_path)
    ours.fuse_projections()
    assert ours.backbone.enable_decode_stack(programs=3) and ours.depth.enable_decode_stack(programs=2)
    ids = torch.randint(0, 290, (1, 7))
    calls = _count_stack_calls(monkeypatch)
    with_stack = ours.generate_codes(ids, max_frames=6)
    # per frame: k - 2 one-token depth passes (the first pass takes two positions) and a backbone step
    assert len(calls) >= 3 * (k - 1)
    for t in (ours.backbone, ours.depth):
        t.stack = None
    plain = ours.generate_codes(ids, max_frames=6)
    assert with_stack.shape[0] >= 3 and len(set(plain[:, 1].tolist())) > 1
    torch.testing.assert_close(with_stack, plain, rtol=0, atol=0)


def test_probe_switches_keep_the_step(monkeypatch) -> None:
    """bench/stack_probe.py's switches: all phases named one by one, and other K-loop depths or K
    tiles, compute the same step; a tile that does not divide K is refused with a clear error."""
    _interpreted(monkeypatch)
    from realtime.kernels import decode_stack as ds

    torch.manual_seed(1)
    model = Transformer(CFG).eval()
    model.fuse_projections()
    assert model.enable_decode_stack()
    w = model.stack
    cache = KVCache(CFG, n_slots=2, max_seq_len=CFG.max_seq_len, device="cpu", dtype=torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    x = torch.randn(2, CFG.dim)
    pos = torch.tensor([70, 5])
    slots = torch.tensor([1, 0])
    cos, sin = model.rope_table(cache.max_seq_len, torch.float32)

    def run(**kw):  # noqa: ANN003, ANN202
        k, v = cache.k.clone(), cache.v.clone()
        return ds.decode_stack(w, x, pos, k, v, slots, cos, sin, programs=3, **kw), k, v

    ref = run()
    for kw in (dict(phases=list(range(ds.PHASES * CFG.n_layers + 1))), dict(tune={"STAGES": 2, "BK_GU": 32}),
               dict(tune={"GU_ONE_LOOP": False}), dict(tune={"ONE_POLLER": False}), dict(prefetch=True),
               dict(tune={"EARLY": 1}), dict(tune={"EARLY": 1, "GU_ONE_LOOP": False}), dict(tune={"ATT_PREFETCH": 4}),
               dict(tune={"ATT_EARLY": 1}), dict(tune={"ATT_REGS": 1})):
        for got, want in zip(run(**kw), ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # one row: the elementwise GEMV phases (FMA), with the first tiles early and gate, up apart
    def run1(**kw):  # noqa: ANN003, ANN202
        k, v = cache.k.clone(), cache.v.clone()
        return ds.decode_stack(w, x[1:], pos[1:], k, v, slots[1:], cos, sin, programs=3, **kw), k, v

    ref1 = run1(tune={"FMA": 0})  # the tl.dot products (the default at one row is FMA=15)
    for tune in ({"FMA": 15}, {"FMA": 15, "EARLY": 1}, {"FMA": 15, "GU_ONE_LOOP": False}, {"FMA": 15, "EARLY": 1,
                                                                                       "GU_ONE_LOOP": False}, {}):
        for got, want in zip(run1(tune=tune), ref1):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # ATT_REGS: one attention item a program (8 programs here), its first key block from before
    # the barrier and the own key put into the block; two rows (a 128-key chunk, the own key in its
    # second block), and one row at each position (64-key chunks: one split, or two merged); with
    # FMA masks at one row
    for sel, fma in ((slice(0, 2), 0), (slice(0, 1), 15), (slice(1, 2), 6), (slice(0, 1), 9)):
        m = sel.stop - sel.start
        meta = ds.launch_meta(m, CFG.dim, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, CFG.intermediate_size,
                              CFG.n_layers, CFG.max_seq_len, 8, 4, False, True)
        assert meta["ITEMS"] == 1  # (else ATT_REGS would be switched off)

        def run8(**kw):  # noqa: ANN003, ANN202
            k, v = cache.k.clone(), cache.v.clone()
            return ds.decode_stack(w, x[sel], pos[sel], k, v, slots[sel], cos, sin, programs=8, **kw), k, v

        for got, want in zip(run8(tune={"ATT_REGS": 1, "FMA": fma}), run8(tune={"ATT_REGS": 0, "FMA": 0})):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mask of phases"):
        run1(tune={"FMA": 16})
    # only the first layer's phases: the second layer's K/V stay as they were
    _, k, _ = run(phases=list(range(ds.PHASES)))
    assert torch.equal(k[1], cache.k[1]) and not torch.equal(k[0], cache.k[0])
    with pytest.raises(ValueError, match="BK_D=24"):
        run(tune={"BK_D": 24})
    with pytest.raises(ValueError, match="tune takes"):
        run(tune={"P": 4})
