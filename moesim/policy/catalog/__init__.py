"""Systems of the seed papers and their baselines; each module registers its components and systems.

Importing this package registers them all (``moesim.policy.systems`` does so).
"""
