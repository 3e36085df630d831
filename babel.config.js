// Jest transforms the ES modules of some dependencies with babel.
module.exports = {
  presets: [['@babel/preset-env', { targets: { node: 'current' } }]]
};
