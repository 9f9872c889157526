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
