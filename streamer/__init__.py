"""streamer: an online streaming continual learner with live monitoring."""

__all__ = ["__version__"]
__version__ = "0.1.0"
