"""The lab: training, evaluation, data and corpora, geometry and the task suite.

Beside the serving core (``model``): the lab imports the core, never the other way, so serving
a checkpoint loads none of it (tests/model/test_layout.py).
"""
