"""The disaggregated-prefill bootstrap registry (vLLM's Mooncake ``/register``, ``/query``).

``payload`` reads and bounds what a prefill worker posts; ``registry`` decides,
on evidence, who holds each DP rank's entry. Both are sans-IO: the server
(``coordinator.server.bootstrap``) moves the HTTP requests and runs the probes
the registry asks for.
"""
