"""Benchmarks for dp-coordinator: latency, throughput and memory against a floor and peers.

Run `python -m bench --help`. Results land in bench/results/.
"""
