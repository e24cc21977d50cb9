"""How the picker reads one of Envoy's gRPC access log entries (its own copy of Envoy's messages,
the same bytes as Envoy sends): whose end it is, how it ended, and when its answer came."""

from __future__ import annotations

from bouncer.core.outcomes import Reason, Terminal
from bouncer.gateway.fronts import envoy_wire_pb2 as accesslog_pb2
from bouncer.gateway.fronts.access_log_wire import ended

ID = "x-bouncer-request-id"


def _entry(status: int = 200, sent_ms: int | None = 2, came_ms: int | None = 350, **flags: bool):
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.request.request_headers[ID] = "r1"
    e.request.request_id = "envoy-1"
    e.response.response_code.value = status
    if sent_ms is not None:
        e.common_properties.time_to_last_upstream_tx_byte.FromMilliseconds(sent_ms)
    if came_ms is not None:
        e.common_properties.time_to_first_upstream_rx_byte.FromMilliseconds(came_ms)
    for name, on in flags.items():
        setattr(e.common_properties.response_flags, name, on)
    return e


def test_a_completed_answer_dated_from_the_request_sent_to_its_first_byte():
    end = ended(_entry(), ID)
    assert (end.request_id, end.envoy_request_id, end.status, end.terminal, end.reason) == \
        ("r1", "envoy-1", 200, Terminal.COMPLETED, None)
    assert abs(end.answered_after_s - 0.348) < 1e-9


def test_no_date_where_envoy_never_got_an_answer_byte():
    end = ended(_entry(status=503, came_ms=None, upstream_connection_failure=True), ID)
    assert (end.terminal, end.reason, end.answered_after_s) == (Terminal.FAILED, Reason.UPSTREAM_ERROR, None)


def test_a_client_that_left_and_an_entry_of_no_request_of_the_pickers():
    assert ended(_entry(downstream_remote_reset=True), ID).terminal is Terminal.CANCELLED
    other = _entry()
    del other.request.request_headers[ID]
    assert ended(other, ID) is None


def test_a_client_that_left_before_its_request_got_the_pickers_id_is_named_by_envoys():
    """It left while Envoy was taking the picker's answer: the picker finds it by `x-request-id`."""
    left = _entry(status=0, came_ms=None, downstream_connection_termination=True)
    del left.request.request_headers[ID]
    end = ended(left, ID)
    assert (end.request_id, end.envoy_request_id, end.status, end.terminal, end.reason) == \
        (None, "envoy-1", None, Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED)
