"""The default shape's ext_proc front (``brain/decide.py``): what it takes from Envoy's messages."""

from __future__ import annotations


def test_a_session_envoy_read_is_taken_whole_or_not_at_all():
    """What Envoy's json_to_metadata forwards (a client's field, as long as its body): a session id past
    MAX_SESSION_CHARS is no session, never a cut one that would name another session."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.brain.decide import MAX_SESSION_CHARS, body_sessions
    from extproc.contract import BODY_METADATA_NAMESPACE, SESSION_METADATA
    from extproc.core.profile import BODY_SESSION_PREFIX

    req = ep.ProcessingRequest()
    fields = req.metadata_context.filter_metadata[BODY_METADATA_NAMESPACE].fields
    fields[SESSION_METADATA + "conversation_id"].string_value = "c" * MAX_SESSION_CHARS
    fields[SESSION_METADATA + "thread_id"].string_value = "t" * (MAX_SESSION_CHARS + 1)
    fields["model"].string_value = "m"
    assert body_sessions(req) == {BODY_SESSION_PREFIX + "conversation_id": "c" * MAX_SESSION_CHARS}


def test_a_decision_that_raises_is_counted_logged_by_its_kind_and_ends_the_call_with_internal(caplog):
    """A bug in a decision costs that request the brain (Envoy fails open on the call's error), and says so: counted by
    call in ``warmroute_call_faults_total`` and logged by the error's kind, never its message (the real P/D test's
    UnboundLocalError failed every disaggregated call open, seen only as grpcio's traceback)."""
    import asyncio
    import logging
    from collections import Counter

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from extproc.brain.decide import ExternalProcessor

    def decide(headers, body, phase):
        raise UnboundLocalError("cannot access local variable 'kp' where it is not associated with a value")

    faults: Counter[str] = Counter()

    async def run() -> grpc.StatusCode:
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(decide, faults=faults), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ep_grpc.ExternalProcessorStub(ch).Process()
                await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"secret prompt": 1}',
                                                                               end_of_stream=True)))
                await call.done_writing()
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return await call.code()
        finally:
            await server.stop(None)

    with caplog.at_level(logging.INFO):
        assert asyncio.run(run()) == grpc.StatusCode.INTERNAL
    assert faults == {"body": 1}
    assert "UnboundLocalError" in caplog.text and "kp" not in caplog.text and "secret prompt" not in caplog.text
