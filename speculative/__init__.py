"""specdec's shared package: model running, sampling and the speculative round.

Both model services (draft_service, target_service) run models through
`model_runner`; the coordinator, the tests and the bench drive them through the
same speculative round (`round.py`), in one process or over gRPC.
"""
