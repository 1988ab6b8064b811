"""Control plane: engine state, evidence, holds, probes, readmission and the monitor pass."""
