"""The engine: requests, sampling parameters, the scheduler, the sampler and the step loop."""
