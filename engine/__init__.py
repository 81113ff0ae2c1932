"""The engine core shared by both workers: sequences, scheduler, model runner, sampler."""
