"""The placement simulator on a small cluster: every job finishes under every policy, ours never leaves a
partial gang holding GPUs, and its local fraction beats the default's (the full-size run is bench/)."""

from __future__ import annotations

from bench.placement_sim import POLICIES, Simulation, make_world, table


def test_small_cluster_all_policies():
    results = {}
    for policy in POLICIES:
        nodes, sizes, jobs = make_world(64, 160, seed=3)
        results[policy] = Simulation(policy, nodes, sizes, jobs, seed=3).run()
        assert len(results[policy].waits) == len(jobs)  # every job ran
        assert all(n.free == 8 for n in nodes)  # and gave its GPUs back
        # every pod read its shard once: local + peer + origin bytes add up to what the jobs read
        assert results[policy].total == sum(sizes[j.dataset] // j.pods * j.pods for j in jobs)
    ours = results["cachefs"]
    assert ours.deadlocks == 0 and ours.partial_gpu_hours == 0
    assert results["default"].deadlocks > 0  # the bursts do deadlock per-pod placement
    assert ours.local_fraction > results["default"].local_fraction
    assert "cachefs" in table(list(results.values()))


def test_sharded_groups_read_most_bytes_from_the_group_and_ours_keeps_jobs_in_the_group_holding_their_data():
    results = {}
    for policy in ("default", "cachefs"):
        nodes, sizes, jobs = make_world(64, 160, seed=3)
        sim = Simulation(policy, nodes, sizes, jobs, seed=3, sharded=True)
        results[policy] = sim.run()
        assert len(results[policy].waits) == len(jobs)
        assert results[policy].total == sum(sizes[j.dataset] // j.pods * j.pods for j in jobs)
        for g in sim.groups.values():  # a group holds each byte once, within its members' disks together
            assert sum(g.cache.values()) <= g.capacity
            assert all(0 <= b <= sizes[ds] for ds, b in g.cache.items())
        # a node's own view is its share of what its group holds
        n = nodes[0]
        assert sim.held(n) == {ds: b // sim.members[n.leaf] for ds, b in sim.groups[n.leaf].cache.items()}
    ours, default = results["cachefs"], results["default"]
    assert ours.peer_bytes > ours.local_bytes > 0  # most of what the group holds is on the other members
    assert ours.group_fraction > default.group_fraction


def test_ours_over_dra_places_exactly_as_over_extended_resources():
    """The same world through DraInventory and NodeCache (GPUs and cliques from ResourceSlices, demand from
    templates, allocated claims): every node state checked against the simulator's books, the same figures."""
    from bench.placement_dra import DraSimulation

    ext = Simulation("cachefs", *make_world(64, 160, seed=3), seed=3).run()
    sim = DraSimulation(*make_world(64, 160, seed=3), seed=3)
    dra = sim.run()
    assert sim.checked_states > 1000
    assert (dra.local_bytes, dra.peer_bytes, dra.origin_bytes, dra.waits, dra.multi_leaf) == (
        ext.local_bytes, ext.peer_bytes, ext.origin_bytes, ext.waits, ext.multi_leaf)
