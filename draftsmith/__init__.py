"""Shared core of draftsmith: the recipe parser, the one-line error convention and target loading.

Every stage (data_prep, trainer, eval) imports from here and never from each other.
"""
