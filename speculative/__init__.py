"""specdec's algorithm, shared by every process: the words the services speak (protocol.py,
torch-free), the speculative round over two peers (round.py, torch-free) and the sampling maths
that makes it exact (sampling.py); errors.py names what can go wrong; tiny.py makes the tiny
random models the tests run on.

The model services run models in model_service/; the coordinator drives the round over gRPC
(coordinator/peers.py); the tests and the bench drive it in one process (model_service/local.py).
"""
