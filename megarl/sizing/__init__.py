"""Sizing a run before it starts (``megarl plan``): each rank's memory per phase from the model's
tensors (``memory``), an analytic step-time model (``cost``), and the layouts that fit (``proposals``)."""
