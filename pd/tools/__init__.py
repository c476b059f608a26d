"""Tools apart from the runtime: benchmarks, load generator, GPU check, fault report."""
