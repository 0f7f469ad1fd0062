"""Asynchronous grad staging (CUDA grads) and arena pinning, tested on the CPU.

On a GPU the host tier copies grads D2H on a side stream and hands a piece to the worker only
once its copy event has completed (tiers/staging.py). That hand-off logic depends only on an
event's query()/synchronize(), so here a stager stands in for CUDA: its "copy" runs only when
the test completes the event (until then the staging slot holds stale bytes, so a piece sent
early would step on the wrong grads and break the bitwise comparisons). CUDA itself is
exercised by tests/test_gpu_staging.py.

Pinning: a CPU model never pins; a failed cudaHostRegister (a fake runtime standing in for
CUDA) clears the error it set, warns once, and leaves the arena unpinned.
"""

import contextlib
import types
import warnings

import pytest
import torch
from helpers import assert_bitwise_equal, inputs, load, make_grads, make_states, ref_step
from torch import nn

import hybrid_opt.shm as shm
from hybrid_opt import HybridAdamW
from hybrid_opt.shm import SharedArena
from hybrid_opt.testing import debug_view
from hybrid_opt.tiers.host import HostTier
from hybrid_opt.worker import protocol as proto

SLOT = 4096
TIMEOUT_S = 20.0


class FakeEvent:
    """A copy in flight: it happens when the test (or synchronize()) completes the event."""

    def __init__(self, fill):
        self.fill, self.done, self.synchronized = fill, False, False

    def complete(self):
        if not self.done:
            self.done = True
            self.fill()

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized = True
        self.complete()


class FakeStager:
    def __init__(self, fail_at=None):
        self.events, self.fail_at = [], fail_at

    def copy(self, fill):
        if self.fail_at is not None and len(self.events) == self.fail_at:
            raise RuntimeError("injected copy failure")
        ev = FakeEvent(fill)
        self.events.append(ev)
        return ev


def spy_sends(tier):
    """[(op, subgroup, offset)] of every task the tier sends to its worker, in order."""
    sent, send = [], tier.client.send

    def logged(task, gather=()):
        sent.append((task.op, task.subgroup, task.elem_offset))
        return send(task, gather)

    tier.client.send = logged
    return sent


def steps_sent(sent):
    return [(sg, off) for op, sg, off in sent if op == proto.OP_STEP]


def assert_committed_state_still_steps(tier, states, grads) -> None:
    """After an abandoned launch the committed state is untouched and subgroup 0 still steps
    (synchronously, no stager) bitwise like the reference."""
    tier.io.use_stager(None)
    assert tier.stepping.step(0, grads[0], inputs()) == "stepped"
    ref_step(states[0], grads[0], inputs())
    assert_bitwise_equal(tier.master(0), states[0]["p"], "param after the abandoned launch")


def async_tier(numels, **kw):
    tier = HostTier(list(numels), slot_numel=SLOT, staging_slots=8, timeout_s=TIMEOUT_S, **kw)
    tier.io.set_remote_gather(False)  # the worker would read CPU grads itself, bypassing staging
    tier.io.use_stager(FakeStager())
    return tier


# ============================================================================= the tier's queue
def test_pieces_go_to_the_worker_only_once_their_copies_landed_and_in_order():
    numels = [2 * SLOT + 5, SLOT + 3]  # 3 + 2 pieces
    states, grads = make_states(numels), make_grads(numels)
    tier = async_tier(numels, spare_banks=2)
    try:
        load(tier, states)
        sent = spy_sends(tier)
        free_before = tier.io.free_slots
        assert tier.stepping.speculate(0, grads[0], inputs(), wait=False)
        assert tier.stepping.speculate(1, grads[1], inputs(), wait=False)
        events = tier.io.copy_stager.events
        order = [(0, 0), (0, SLOT), (0, 2 * SLOT), (1, 0), (1, SLOT)]
        assert len(events) == len(order) and tier.io.copies_in_flight() == len(order)
        tier.io.poll()
        assert steps_sent(sent) == [] and tier.io.pieces_in_flight == 0, "sent before any copy landed"
        # every queued piece holds its slot: none can be reused before the worker is done
        assert tier.io.free_slots == free_before - len(order)

        events[1].complete()  # out of order: the first piece still blocks the rest
        tier.io.poll()
        assert steps_sent(sent) == []
        events[0].complete()
        tier.io.poll()
        assert steps_sent(sent) == order[:2]
        events[4].complete()
        events[2].complete()
        tier.io.poll()
        assert steps_sent(sent) == order[:3]  # piece 3 has not landed: 4 waits behind it

        # finish() (step()) waits for the rest itself
        outcome = tier.stepping.finish({sg: (grads[sg], inputs()) for sg in range(2)})
        assert outcome == {0: "committed", 1: "committed"}
        assert steps_sent(sent) == order
        assert events[3].synchronized and all(e.done for e in events)
        assert tier.io.copies_in_flight() == 0 and tier.io.free_slots == free_before
        for sg in range(2):
            ref_step(states[sg], grads[sg], inputs())
            for k, name in (("p", "param"), ("m", "exp_avg"), ("v", "exp_avg_sq")):
                assert_bitwise_equal(tier.state(sg)[name], states[sg][k], f"subgroup {sg} {name}")
    finally:
        tier.close()


def test_poll_if_copying_sends_the_pieces_that_landed_and_is_idle_without_copies():
    numels = [SLOT + 3]  # 2 pieces
    states, grads = make_states(numels), make_grads(numels)
    tier = async_tier(numels, spare_banks=2)
    try:
        load(tier, states)
        sent = spy_sends(tier)
        tier.io.poll_if_copying()  # nothing copying: nothing to do
        assert tier.stepping.speculate(0, grads[0], inputs(), wait=False)
        events = tier.io.copy_stager.events
        tier.io.poll_if_copying()
        assert steps_sent(sent) == [] and tier.io.copies_in_flight() == 2
        events[0].complete()
        tier.io.poll_if_copying()  # what a grad hook calls: copies_in_flight() + poll()
        assert steps_sent(sent) == [(0, 0)] and tier.io.copies_in_flight() == 1
        events[1].complete()
        tier.io.poll_if_copying()
        assert steps_sent(sent) == [(0, 0), (0, SLOT)] and tier.io.copies_in_flight() == 0
        assert tier.stepping.finish({0: (grads[0], inputs())}) == {0: "committed"}
        ref_step(states[0], grads[0], inputs())
        assert_bitwise_equal(tier.master(0), states[0]["p"], "param after poll_if_copying")
    finally:
        tier.close()


def test_a_failed_launch_never_sends_its_queued_pieces_and_frees_their_slots_once_copied():
    numels = [3 * SLOT]
    states, grads = make_states(numels), make_grads(numels)
    tier = async_tier(numels, spare_banks=1)
    tier.io.use_stager(FakeStager(fail_at=1))  # the second piece's copy fails
    try:
        load(tier, states)
        sent = spy_sends(tier)
        free_before = tier.io.free_slots
        with pytest.raises(RuntimeError, match="injected copy failure"):
            tier.stepping.speculate(0, grads[0], inputs(), wait=False)
        assert tier.stepping.speculated() == []
        first = tier.io.copy_stager.events[0]
        # the first piece's copy may still be writing its slot: the slot stays out of the ring
        assert tier.io.free_slots == free_before - 1
        first.complete()
        tier.io.poll()
        assert tier.io.free_slots == free_before and tier.io.copies_in_flight() == 0
        assert steps_sent(sent) == [], "a piece of an abandoned step reached the worker"
        # the committed state is untouched and the tier still steps (synchronously now)
        assert_committed_state_still_steps(tier, states, grads)
    finally:
        tier.close()


def test_an_inverse_mode_launch_failing_mid_subgroup_frees_no_slot_a_copy_still_writes():
    """Inverse mode hands a subgroup's pieces on only once all are staged: a copy failing on
    the second piece leaves the first one staged but not queued. Its slot goes back to the
    ring only after its copy has landed."""
    numels = [3 * SLOT]
    states, grads = make_states(numels), make_grads(numels)
    tier = async_tier(numels, rollback="inverse")
    tier.io.use_stager(FakeStager(fail_at=1))
    try:
        load(tier, states)
        sent = spy_sends(tier)
        free_before = tier.io.free_slots
        with pytest.raises(RuntimeError, match="injected copy failure"):
            tier.stepping.speculate(0, grads[0], inputs(), wait=False)
        first = tier.io.copy_stager.events[0]
        assert first.synchronized and first.done, "the slot was freed while its copy was in flight"
        assert tier.io.free_slots == free_before and tier.io.copies_in_flight() == 0
        assert steps_sent(sent) == [] and tier.stepping.speculated() == []
        assert_committed_state_still_steps(tier, states, grads)
    finally:
        tier.close()


def test_inverse_mode_checks_finiteness_once_the_copies_landed():
    numels = [2 * SLOT, SLOT]
    states, grads = make_states(numels), make_grads(numels)
    grads[1][7] = float("inf")
    tier = async_tier(numels, rollback="inverse")
    try:
        load(tier, states)
        sent = spy_sends(tier)
        assert tier.stepping.speculate(0, grads[0], inputs(), wait=False)
        assert tier.stepping.speculate(1, grads[1], inputs(), wait=False)
        assert steps_sent(sent) == []  # checked as a whole subgroup: nothing before all landed
        for ev in tier.io.copy_stager.events[:2]:
            ev.complete()
        tier.io.poll()
        assert steps_sent(sent) == [(0, 0), (0, SLOT)]
        tier.io.copy_stager.events[2].complete()
        tier.io.poll()
        assert steps_sent(sent) == [(0, 0), (0, SLOT)]  # subgroup 1's grads are not finite
        outcome = tier.stepping.finish({0: (grads[0], inputs())}, overflow=False)
        assert outcome[0] == "committed"
        ref_step(states[0], grads[0], inputs())
        assert_bitwise_equal(tier.master(0), states[0]["p"], "inverse-mode speculated param")
    finally:
        tier.close()


@pytest.mark.parametrize("short_of", ["bank", "slots"])
def test_a_refused_speculation_still_hands_over_the_pieces_whose_copies_landed(short_of):
    """A hook whose subgroup finds no spare bank (or, wait=False, too few free staging slots)
    is refused, but it still collects what came back and sends the pieces whose copies landed:
    a backward whose every hook completes a subgroup keeps the worker fed."""
    numels = [SLOT + 3, 3 * SLOT if short_of == "slots" else 100]  # 2 pieces; then 3 or 1
    states, grads = make_states(numels), make_grads(numels)
    tier = HostTier(
        list(numels),
        slot_numel=SLOT,
        staging_slots=4,
        timeout_s=TIMEOUT_S,
        spare_banks=1 if short_of == "bank" else 2,
    )
    tier.io.set_remote_gather(False)
    tier.io.use_stager(FakeStager())
    try:
        load(tier, states)
        sent = spy_sends(tier)
        assert tier.stepping.speculate(0, grads[0], inputs(), wait=False)
        for event in tier.io.copy_stager.events:
            event.complete()  # subgroup 0's staging copies have landed, none sent yet
        assert steps_sent(sent) == []
        assert tier.stepping.speculate(1, grads[1], inputs(), wait=False) is False  # 2 slots free of 3
        assert steps_sent(sent) == [(0, 0), (0, SLOT)] and tier.io.copies_in_flight() == 0
        assert tier.stepping.finish({sg: (g, inputs()) for sg, g in enumerate(grads)}) == {
            0: "committed",
            1: "stepped",
        }
        for sg, (st, g) in enumerate(zip(states, grads)):
            ref_step(st, g, inputs())
            assert_bitwise_equal(tier.master(sg), st["p"], f"subgroup {sg}")
    finally:
        tier.close()


def test_close_lets_copies_in_flight_land_before_the_arena_goes():
    numels = [SLOT]
    tier = async_tier(numels, spare_banks=1)
    load(tier, make_states(numels))
    assert tier.stepping.speculate(0, make_grads(numels)[0], inputs(), wait=False)
    (event,) = tier.io.copy_stager.events
    tier.close()
    assert event.synchronized and event.done


# ============================================================================= the optimizer
WIDTH, DEPTH, SUBGROUP = 64, 4, 4096


def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)) for _ in range(n)]


def train(speculative, rollback="exact", steps=4, complete_in_hooks=False):
    """offload 1.0; with speculation, grads are staged through copy events this completes
    only from later grad hooks (complete_in_hooks) or never (step() waits for them)."""
    net = make_mlp()
    log, hooks = [], []
    with HybridAdamW(
        net.parameters(),
        lr=1e-2,
        offload_fraction=1.0,
        speculative=speculative,
        rollback=rollback,
        subgroup_numel=SUBGROUP,
        spare_banks=16,
    ) as opt:
        tier = debug_view(opt).host
        stager = None
        if speculative:
            tier.io.set_remote_gather(False)
            stager = FakeStager()
            tier.io.use_stager(stager)
            sent, send = [], tier.client.send

            def checked_send(task, gather=()):
                if task.op == proto.OP_STEP:  # one event per piece, handed over in order
                    sent.append(task)
                    assert len(sent) <= sum(e.done for e in stager.events), (
                        "a piece went to the worker before its copy landed"
                    )
                return send(task, gather)

            tier.client.send = checked_send
            if complete_in_hooks:

                def land_all(p):
                    for e in stager.events:
                        e.complete()

                # runs after the optimizer's; removed at the end (the events it reaches name the
                # params: a cycle through a tensor's hooks that gc does not collect)
                hooks = [p.register_post_accumulate_grad_hook(land_all) for p in net.parameters()]
        for x, y in batches(steps):
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            if speculative:
                before = len(sent)
                log.append(dict(in_flight=tier.io.copies_in_flight(), sent_in_backward=before))
                sent.clear()
            opt.step()
            if speculative:
                log[-1].update(opt.stats["speculation"], sent_in_step=len(sent))
                sent.clear()
        n_host = sum(1 for t in opt.plan.tiers if t != "device")
        state = opt.state_dict()
        for h in hooks:
            h.remove()
    return [p.detach().clone() for p in net.parameters()], state, log, n_host


def assert_same_run(a, b):
    for i, (p, q) in enumerate(zip(a[0], b[0])):
        assert torch.equal(p, q), f"param {i} differs"
    for i, st in a[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b[1]["state"][i][k]), f"state[{i}][{k}] differs"


@pytest.mark.parametrize("rollback", ["exact", "inverse"])
def test_step_waits_for_the_copies_and_matches_plain_bitwise(rollback):
    spec, plain = train(True, rollback), train(False, rollback)
    assert_same_run(spec, plain)
    log, n_host = spec[2], spec[3]
    assert n_host >= 3
    first = 1 if rollback == "inverse" else 0  # inverse mode speculates from the second step
    for entry in log[first:]:
        assert entry["in_flight"] > 0 and entry["sent_in_backward"] == 0, entry
        assert entry["sent_in_step"] > 0 and entry["committed"] == n_host, entry


def test_later_hooks_hand_over_the_pieces_whose_copies_landed():
    spec, plain = train(True, complete_in_hooks=True), train(False)
    assert_same_run(spec, plain)
    for entry in spec[2]:
        # the last hook's pieces land after it: step() sends those
        assert entry["sent_in_backward"] > 0 and entry["committed"] == spec[3], entry


@pytest.mark.parametrize("zero_grad_first", [True, False])
def test_an_attached_grad_scaler_is_read_by_zero_grad_not_by_the_hooks(zero_grad_first):
    """get_scale() copies a CUDA scale to the host (a sync). zero_grad() after update() copies it
    ahead (Speculator.prefetch_scale): no hook reads it but the first backward's, before the
    scaler has a scale tensor. A zero_grad() before update() leaves it to the first hook of the
    next backward, once. Either way each speculation commits: the scale followed every update."""
    net = make_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    reads = []
    get_scale = scaler.get_scale
    scaler.get_scale = lambda: reads.append(1) or get_scale()
    with HybridAdamW(
        net.parameters(),
        lr=1e-2,
        offload_fraction=1.0,
        subgroup_numel=SUBGROUP,
        spare_banks=16,
        speculative=True,  # "auto" would not speculate on this CPU-only host
    ) as opt:
        opt.attach_grad_scaler(scaler)
        n_host = sum(1 for t in opt.plan.tiers if t != "device")
        scales, per_backward = [], []
        for x, y in batches(4):
            if zero_grad_first:
                opt.zero_grad()
            reads.clear()
            scaler.scale(((net(x) - y) ** 2).mean()).backward()
            per_backward.append(len(reads))
            scales.append(get_scale())
            scaler.step(opt)
            if not zero_grad_first:
                opt.zero_grad()  # before update(): what it copied is stale by the next backward
            scaler.update()
            # the scale followed every update: each speculation committed
            assert opt.stats["speculation"]["committed"] == n_host, opt.stats["speculation"]
    assert per_backward == ([1, 0, 0, 0] if zero_grad_first else [1, 1, 1, 1]), per_backward
    assert len(set(scales)) == len(scales), scales  # growth_interval=1: it changed every step


def test_a_tensor_lr_is_read_once_per_change_not_once_per_hook(monkeypatch):
    """A tensor lr (on a GPU, `.item()` is a host sync) is read by the first hook after it
    changes; the later hooks reuse it, and the run is the float lr's, bitwise."""
    runs = []
    for tensor_lr in (True, False):
        net = make_mlp()
        lr = torch.tensor(1e-2, dtype=torch.float64) if tensor_lr else 1e-2
        reads = []
        item = torch.Tensor.item
        monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t is lr) or item(t))
        with HybridAdamW(
            net.parameters(),
            lr=lr,
            offload_fraction=1.0,
            subgroup_numel=SUBGROUP,
            spare_banks=16,
            speculative=True,
        ) as opt:
            n_host = sum(1 for t in opt.plan.tiers if t != "device")
            assert n_host >= 3
            per_backward = []
            for k, (x, y) in enumerate(batches(4)):
                opt.zero_grad()
                reads.clear()
                ((net(x) - y) ** 2).mean().backward()
                per_backward.append(sum(reads))
                opt.step()
                if k == 1:  # as a scheduler sets a tensor lr: in place
                    if tensor_lr:
                        opt.param_groups[0]["lr"].fill_(5e-3)
                    else:
                        opt.param_groups[0]["lr"] = 5e-3
                assert opt.stats["speculation"]["committed"] == n_host, opt.stats["speculation"]
            runs.append([p.detach().clone() for p in net.parameters()])
        if tensor_lr:
            # read by the first backward and by the first after the change, once each
            assert per_backward == [1, 0, 1, 0], per_backward
        monkeypatch.undo()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ============================================================================= pinning
class FakeRuntime:
    """Stands in for libcudart: register returns `code`; records what was called."""

    def __init__(self, code):
        self.code, self.calls = code, []

    def register(self, ptr, nbytes):
        self.calls.append(("register", ptr, nbytes))
        return self.code

    def unregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0

    def clear_error(self):
        self.calls.append(("clear",))
        return self.code

    def error_string(self, code):
        return "invalid argument"


def spy_pin(monkeypatch):
    calls, pin = [], SharedArena.pin

    def logged(arena, *args, **kwargs):
        calls.append(arena)
        return pin(arena, *args, **kwargs)

    monkeypatch.setattr(SharedArena, "pin", logged)
    return calls


def test_a_cpu_model_never_pins(monkeypatch):
    calls = spy_pin(monkeypatch)
    tier = HostTier([100], pin=False, timeout_s=TIMEOUT_S)
    try:
        assert calls == [] and tier.arena.pinned is False
    finally:
        tier.close()
    tier = HostTier([100], pin=True, timeout_s=TIMEOUT_S)  # the flag reaches the arena
    try:
        assert calls == [tier.arena]
        assert tier.arena.pinned is False  # no CUDA here
    finally:
        tier.close()
    calls.clear()
    with HybridAdamW(make_mlp().parameters(), offload_fraction=1.0, subgroup_numel=SUBGROUP) as opt:
        assert debug_view(opt).host is not None and calls == [] and not debug_view(opt).host.arena.pinned


def test_a_failed_pin_clears_the_error_warns_once_and_runs_unpinned(monkeypatch):
    runtime = FakeRuntime(code=1)
    monkeypatch.setattr(shm, "cuda_runtime", lambda: runtime)
    monkeypatch.setattr(shm, "_pin_warned", False)
    arenas = [SharedArena(1 << 16), SharedArena(1 << 16)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [a.pin() for a in arenas] == [False, False]
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "could not be pinned" in msgs[0] and "invalid argument" in msgs[0], msgs
        assert "speculative=False" in msgs[0], msgs  # what the unpinned copies cost, and the way out
        assert [c[0] for c in runtime.calls] == ["register", "clear"] * 2
        assert not any(a.pinned for a in arenas)
        arenas[0].tensor(0, 16, torch.float32).fill_(1.0)  # still ordinary shared memory
    finally:
        for a in arenas:
            a.close()
    assert ("unregister",) not in [c[:1] for c in runtime.calls]


def test_a_pinned_arena_is_registered_once_and_unregistered_at_close(monkeypatch):
    runtime = FakeRuntime(code=0)
    monkeypatch.setattr(shm, "cuda_runtime", lambda: runtime)
    arena = SharedArena(1 << 16)
    assert arena.pin() and arena.pin() and arena.pinned
    ptr = arena.tensor(0, 1, torch.uint8).data_ptr()
    assert runtime.calls == [("register", ptr, arena.nbytes)]
    arena.close()
    assert runtime.calls[-1] == ("unregister", ptr) and not arena.pinned


def test_the_arena_is_registered_and_unregistered_in_the_params_device_context(monkeypatch):
    """cudaHostRegister/Unregister act in the current device's context (and create one there):
    a model on cuda:1 while cuda:0 is current pins under cuda:1. The device context is faked
    here; the same path runs for real on two GPUs (tests/test_gpu_optimizer.py)."""
    current = [None]

    @contextlib.contextmanager
    def on(device):
        before, current[0] = current[0], device
        try:
            yield
        finally:
            current[0] = before

    class Recording(FakeRuntime):
        def register(self, ptr, nbytes):
            self.calls.append(("register", current[0]))
            return self.code

        def unregister(self, ptr):
            self.calls.append(("unregister", current[0]))
            return 0

    runtime = Recording(code=0)
    monkeypatch.setattr(shm, "cuda_runtime", lambda: runtime)
    monkeypatch.setattr(shm, "_in_context_of", lambda d: on(d) if d is not None else contextlib.nullcontext())
    cuda1 = torch.device("cuda", 1)
    tier = HostTier([100], pin=cuda1, timeout_s=TIMEOUT_S)
    try:
        assert tier.arena.pinned and runtime.calls == [("register", cuda1)]
    finally:
        tier.close()
    assert runtime.calls == [("register", cuda1), ("unregister", cuda1)]
    arena = SharedArena(1 << 16)  # no device given: the current one, as before
    assert arena.pin()
    arena.close()
    assert runtime.calls[2:] == [("register", None), ("unregister", None)]


def test_register_asks_for_portable_pinning():
    """flags 0 would pin the arena for the current CUDA context only."""
    seen = []

    def register(ptr, nbytes, flags):
        seen.append(flags)
        return 0

    lib = types.SimpleNamespace(
        cudaHostRegister=register,
        cudaHostUnregister=lambda ptr: 0,
        cudaGetLastError=lambda: 0,
        cudaGetErrorString=lambda code: b"",
    )
    assert shm.CudaRuntime(lib).register(4096, 4096) == 0 and seen == [1]


def test_a_gatherer_reads_the_grads_it_was_given_zeros_for_none_and_names_their_memory():
    """tiers/grads.py: subgroups cut across params (the second param spans both, so the second
    subgroup starts inside it; the first one's grad non-contiguous; the third without one), staged by
    __call__ as their slices' grads, zeros where a param has none; segments names each
    contiguous grad's memory at the slice's offset in it, and refuses (None) a piece touching
    the non-contiguous grad or of another dtype. A gatherer reads the grads it was handed,
    even after `p.grad` is replaced."""
    from hybrid_opt.speculation import gatherer_of
    from hybrid_opt.state import layout as L

    params = [torch.zeros(2, 5), torch.zeros(4, 6), torch.zeros(7), torch.zeros(16)]
    first, second = L.layout_group(params, 0, 0, 32, 0)
    assert second.slices[0].param_index == 1 and second.slices[0].param_offset > 0
    params[0].grad = torch.arange(10, dtype=torch.float32).reshape(5, 2).t()  # non-contiguous
    params[1].grad = torch.arange(30, 54, dtype=torch.float32).reshape(4, 6)
    params[3].grad = torch.arange(100, 116, dtype=torch.float32)
    flat = torch.cat([params[0].grad.reshape(-1), params[1].grad.reshape(-1), torch.zeros(7), params[3].grad])
    for sg in (first, second):
        start = sg.slices[0].param_offset + sum(p.numel() for p in params[: sg.slices[0].param_index])
        want = flat[start : start + sg.numel]
        gather = gatherer_of(sg)
        dst = torch.full((sg.numel,), -1.0)
        gather(dst, 0, sg.numel)
        assert torch.equal(dst, want)
        part = torch.full((9,), -1.0)
        gather(part, 5, 9)
        assert torch.equal(part, want[5:14])
    gather = gatherer_of(second)
    inside = second.slices[0]  # the second param's, from its element param_offset
    assert inside.numel == 2
    entries, keep = gather.segments(1, 1, torch.float32)
    assert entries == [(0, params[1].grad.data_ptr() + (inside.param_offset + 1) * 4, 1)]
    assert keep == [params[1].grad]
    assert gatherer_of(first).segments(0, 4, torch.float32) is None  # in the non-contiguous grad
    assert gather.segments(0, 4, torch.float64) is None  # not the slots' dtype
    last = second.slices[-1]
    assert last.param_index == 3
    nograd = next(sl for sl in second.slices if sl.param_index == 2)
    entries, keep = gather.segments(nograd.sub_offset, nograd.numel, torch.float32)
    assert entries == [(0, 0, nograd.numel)] and keep == []
    held = params[3].grad
    params[3].grad = torch.full((16,), 7.0)  # replaced after the gatherer named the grads
    dst = torch.empty(last.numel)
    gather(dst, last.sub_offset, last.numel)
    assert torch.equal(dst, held[last.param_offset : last.param_offset + last.numel])
