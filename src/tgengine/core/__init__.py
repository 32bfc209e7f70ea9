"""The bookkeeping: scheduler, block manager, sequences and the step they plan. Plain Python,
no torch, tested without a model."""
