"""One replay process's work: the policy it builds, its gradients and their reduction, the clean gradient, the
outcome figures, its memory."""
