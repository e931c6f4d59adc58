"""How quantities are computed: taps and rules for known layers, torch.func for the rest."""
