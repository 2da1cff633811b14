"""The parts of `benchmark.peers` (our engine vs OpenVINO GenAI vs llama.cpp on this CPU): where the peers are
installed (`layout`), how they are installed (`install`), the measurements of each system (`ours`,
`openvino_worker`, `llamacpp`), the probes that give the floors (`probes`) and the report (`report`)."""
