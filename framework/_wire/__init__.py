"""Wire formats of the control plane (private: plugins never see them)."""
