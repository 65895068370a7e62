"""The compute-buffer planner never lets two tensors that are alive at the same time share bytes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.graph.ggml import Graph, RemoteBuffer, new_tensor
from orchestrator.graph.planner import plan_memory
from wire.ggml import GGMLType

ALIGN = 32


def live_ranges(graph, inputs, outputs):
    """(first, last) node index during which each tensor's bytes must stay intact."""
    first, last = {}, {}
    for t in inputs:
        first[id(t)], last[id(t)] = -1, len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        first.setdefault(id(node), i)
        last.setdefault(id(node), i)
        for s in node.src:
            last[id(s.root)] = max(last.get(id(s.root), i), i)
    for t in outputs:
        last[id(t)] = len(graph.nodes)
    return first, last


def assert_no_overlap(graph, inputs, outputs, plan):
    first, last = live_ranges(graph, inputs, outputs)
    items = list(plan.offsets.values())
    for i, (a, oa) in enumerate(items):
        assert oa % ALIGN == 0 and oa + a.nbytes <= plan.size
        for b, ob in items[i + 1:]:
            overlap_in_time = first[id(a)] <= last[id(b)] and first[id(b)] <= last[id(a)]
            overlap_in_space = oa < ob + b.nbytes and ob < oa + a.nbytes
            assert not (overlap_in_time and overlap_in_space), (a.name, b.name)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_graphs_never_overlap(data):
    g = Graph()
    weight = new_tensor(GGMLType.F32, (8, 8), "w")
    weight.place(RemoteBuffer(1, 0, 1 << 20), 0)  # already has memory: never planned
    inputs = [new_tensor(GGMLType.F32, (8, data.draw(st.integers(1, 6))), f"in{i}")
              for i in range(data.draw(st.integers(1, 3)))]
    values = list(inputs)
    for i in range(data.draw(st.integers(1, 25))):
        a = data.draw(st.sampled_from(values))
        kind = data.draw(st.sampled_from(["mul_mat", "add", "norm", "view"]))
        if kind == "mul_mat" and a.ne[0] == weight.ne[0]:
            t = g.mul_mat(weight, a, f"mm{i}")
        elif kind == "add":
            b = data.draw(st.sampled_from([v for v in values if v.ne == a.ne]))
            t = g.add(a, b, f"add{i}")
        elif kind == "norm":
            t = g.rms_norm(a, 1e-5, f"norm{i}")
        else:  # a view: shares its source's memory, which must then live as long as the view's users
            t = g.reshape(a, a.ne[0] * a.ne[1]) if kind == "view" else a
        values.append(t)
    outputs = [values[-1].root] if values[-1].root not in inputs else []
    if not g.nodes:
        return
    plan = plan_memory(g, inputs, outputs, ALIGN)
    assert_no_overlap(g, inputs, outputs, plan)
    assert all(id(t) in plan.offsets for t in inputs)
    assert id(weight) not in plan.offsets


def test_memory_is_reused_along_a_chain():
    """A long chain needs about two live activations, not one per node."""
    g = Graph()
    x = new_tensor(GGMLType.F32, (1024,), "x")
    cur = x
    for i in range(50):
        cur = g.rms_norm(cur, 1e-5, f"n{i}")
    plan = plan_memory(g, [x], [cur], ALIGN)
    assert_no_overlap(g, [x], [cur], plan)
    assert plan.size <= 3 * 4096
