"""The runtime: devices, the Kernel API, pass descriptions and the runner, profiling."""
