"""The BLIP-2 family (stage 2): a Q-Former's learned queries become a fixed number of decoder inputs per image."""

from fusion_model.families.late import LateFusionFamily


class QFormerFamily(LateFusionFamily):
    """BLIP-2's generative stage: the Q-Former (from stage 1: `blip2-stage1`) and its projection learn, the decoder
    stays frozen."""

    name = "qformer"
    kind = "qformer"

    def check(self) -> None:
        """Stage 1 trains without the decoder: it is its own family."""
        super().check()
        if self.options.stage == 1:
            raise ValueError("the qformer family trains BLIP-2's stage 2; stage 1 is --model.family blip2-stage1 "
                             "(or late_fusion {kind: qformer, stage: 1})")
