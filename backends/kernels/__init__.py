"""Triton kernels, one per file. Imported lazily: nothing here may be imported at
package import time, so that every module imports on a CPU-only machine without Triton."""
