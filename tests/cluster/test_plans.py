

def test_stations_that_can_work_at_once_count_the_leader_hosts_cores():
    from flowspec_p2p.cluster.plans import parallel_stations

    assert parallel_stations(["a", "a"], "a", True, False, 2) == 2  # three agents of a 2-core host: two at a time
    assert parallel_stations(["a", "a"], "a", False, False, 4) == 3  # the leader holds no layers: a station too
    assert parallel_stations(["b", "c", "d"], "a", False, False, 1) == 4  # one device each
    assert parallel_stations(["a", "a", "a"], "a", False, True, 1) == 4  # emulated devices
