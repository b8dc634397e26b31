"""Measured figures (sizes, times) that tests report; printed in the terminal summary."""

FIGURES: list[str] = []


def figure(text: str) -> None:
    """Record a measured figure (not a check) for the terminal summary."""
    FIGURES.append(text.strip("\n"))
