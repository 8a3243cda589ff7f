import socket

from nbgpu.plan.placement import pick_ports, port_is_free


def test_pick_ports_skips_taken_and_busy_ports():
    busy = {29501, 29503}
    ports = pick_ports(3, base_port=29500, taken=[29500], is_free=lambda p: p not in busy)
    assert ports == (29502, 29504, 29505)


def test_pick_ports_returns_fewer_when_none_are_free():
    assert pick_ports(2, is_free=lambda _p: False) == ()


def test_port_is_free_sees_a_bound_socket():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not port_is_free(port)
    assert port_is_free(port)
