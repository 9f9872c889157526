"""What only the repository runs to measure warmroute: never shipped (the wheel and the image carry ``extproc``
only). ``python -m bench NAME`` runs the scenario ``bench/scenarios/NAME.yaml``; ``harness`` is what the runs share
(peers started, readiness, the engines' counters, pace); ``runs/`` the measurements; ``faults/`` chaos, soak and the
hostile probes."""
