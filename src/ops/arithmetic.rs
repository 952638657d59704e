//! Binary arithmetic with NumPy broadcasting (add, sub, mul, div, maximum, minimum), comparisons
//! (no gradient) and `where`/`masked_fill`. A broadcast operand's gradient is summed back to its
//! shape (`sum_to_shape`).

use crate::backend::{BinaryOp, UnaryOp};
use crate::shape::{broadcast_shapes, broadcast_strides};
use crate::{Error, Result, Tensor};

impl Tensor {
    fn binary_with_rule(
        &self,
        other: &Tensor,
        op: BinaryOp,
        name: &'static str,
        rule: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)> + Send + 'static,
    ) -> Result<Tensor> {
        if let Some((a, b)) = crate::autocast::matched_operands(self, other)? {
            return a.binary_with_rule(&b, op, name, rule);
        }
        let _profile = crate::profile::op(name);
        let y = self.map_binary(other, op)?;
        let (a, b) = (self.detach(), other.detach());
        Ok(Tensor::record(y, name, &[self, other], move |g| {
            let (ga, gb) = rule(g, &a, &b)?;
            Ok(vec![
                Some(ga.sum_to_shape(a.shape())?),
                Some(gb.sum_to_shape(b.shape())?),
            ])
        }))
    }

    /// `self + other` (broadcasting)
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let a = Tensor::from_f32(vec![1.0, 2.0], &[2, 1], Device::cpu()).unwrap();
    /// let b = Tensor::from_f32(vec![10.0, 20.0, 30.0], &[3], Device::cpu()).unwrap();
    /// assert_eq!(a.add(&b).unwrap().shape(), &[2, 3]);
    /// ```
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        self.binary_with_rule(other, BinaryOp::Add, "add", |g, _, _| {
            Ok((g.clone(), g.clone()))
        })
    }
    /// `self - other` (broadcasting)
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        self.binary_with_rule(other, BinaryOp::Sub, "sub", |g, _, _| {
            Ok((g.clone(), g.map_unary(UnaryOp::Neg)?))
        })
    }
    /// `self · other` elementwise (broadcasting)
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        self.binary_with_rule(other, BinaryOp::Mul, "mul", |g, a, b| {
            Ok((g.mul(b)?, g.mul(a)?))
        })
    }
    /// `self / other` elementwise (broadcasting); d/db = −a/b²
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        self.binary_with_rule(other, BinaryOp::Div, "div", |g, a, b| {
            let ga = g.div(b)?;
            let gb = ga.mul(a)?.div(b)?.map_unary(UnaryOp::Neg)?;
            Ok((ga, gb))
        })
    }
    /// Elementwise maximum; the gradient goes to `self` where `self >= other`, else to `other`.
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary_with_rule(other, BinaryOp::Max, "maximum", |g, a, b| {
            let m = a.map_binary(b, BinaryOp::Ge)?;
            Ok((g.mul(&m)?, g.sub(&g.mul(&m)?)?))
        })
    }
    /// Elementwise minimum; the gradient goes to `self` where `self <= other`, else to `other`.
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary_with_rule(other, BinaryOp::Min, "minimum", |g, a, b| {
            let m = a.map_binary(b, BinaryOp::Le)?;
            Ok((g.mul(&m)?, g.sub(&g.mul(&m)?)?))
        })
    }

    /// `1.0` where `self > other`, else `0.0` (no gradient).
    pub fn gt(&self, other: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("gt");
        self.map_binary(other, BinaryOp::Gt)
    }
    /// `1.0` where `self >= other`, else `0.0` (no gradient).
    pub fn ge(&self, other: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("ge");
        self.map_binary(other, BinaryOp::Ge)
    }
    /// `1.0` where `self < other`, else `0.0` (no gradient).
    pub fn lt(&self, other: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("lt");
        self.map_binary(other, BinaryOp::Lt)
    }
    /// `1.0` where `self <= other`, else `0.0` (no gradient).
    pub fn le(&self, other: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("le");
        self.map_binary(other, BinaryOp::Le)
    }
    /// `1.0` where `self == other`, else `0.0` (no gradient).
    pub fn eq(&self, other: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("eq");
        self.map_binary(other, BinaryOp::Eq)
    }
    /// `1.0` where `self != other`, else `0.0` (no gradient).
    pub fn ne(&self, other: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("ne");
        self.map_binary(other, BinaryOp::Ne)
    }

    /// Picks `a` where `cond != 0` and `b` elsewhere; all three broadcast together. `cond` is a
    /// float mask of the same dtype (as comparisons return); gradients flow to `a` and `b`.
    pub fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("where");
        a.check_compatible(b, "where")?;
        a.check_compatible(cond, "where (condition)")?;
        a.check_float("where")?;
        let shape = broadcast_shapes(cond.shape(), a.shape())
            .and_then(|s| broadcast_shapes(&s, b.shape()))
            .map_err(|_| {
                let (c, a, b) = (cond.shape(), a.shape(), b.shape());
                Error::Shape(format!(
                    "where: condition {c:?}, a {a:?} and b {b:?} cannot be broadcast together"
                ))
            })?;
        let sc = broadcast_strides(cond.shape(), &shape)?;
        let sa = broadcast_strides(a.shape(), &shape)?;
        let sb = broadcast_strides(b.shape(), &shape)?;
        let y = Tensor::from_storage(
            cond.storage()
                .where_cond(&sc, a.storage(), &sa, b.storage(), &sb, &shape)?,
            shape,
        );
        let (c, ash, bsh) = (cond.detach(), a.shape().to_vec(), b.shape().to_vec());
        // a branch that needs no gradient (a constant, a mask's fill value) gets none computed
        let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
        Ok(Tensor::record(y, "where", &[a, b], move |g| {
            let zero = Tensor::scalar(0.0, g.dtype(), g.device())?;
            let ga = match need_a {
                true => Some(Tensor::where_cond(&c, g, &zero)?.sum_to_shape(&ash)?),
                false => None,
            };
            let gb = match need_b {
                true => Some(Tensor::where_cond(&c, &zero, g)?.sum_to_shape(&bsh)?),
                false => None,
            };
            Ok(vec![ga, gb])
        }))
    }

    /// Replaces the elements where `mask != 0` by `value` (no gradient flows to those elements).
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let _profile = crate::profile::op("masked_fill");
        let fill = Tensor::scalar(value, self.dtype(), self.device())?;
        let out = Tensor::where_cond(mask, &fill, self)?;
        if out.shape() != self.shape() {
            return Err(Error::Shape(format!(
                "masked_fill: mask {:?} does not broadcast to the tensor's shape {:?}",
                mask.shape(),
                self.shape()
            )));
        }
        Ok(out)
    }
}
