"""The engines beside the package: llama.cpp's build, serving a drafter in llama.cpp with a planned block length
(specdrafter-serve), the eval job's engine arms and its one entry point, and the main job that chains the jobs. The top
floor: it imports every folder below it, and nothing imports it."""
