"""Positional geometry: Hellinger statistics, classical MDS, stress and the five requirements."""
